from tiergram.cli import main

raise SystemExit(main())

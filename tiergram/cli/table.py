"""`tiergram table create | info | verify`: make, describe and check table files."""

from __future__ import annotations

import argparse
import json
import sys

from tiergram.cli.common import add_common
from tiergram.format import TableFile, TableManifest, create_random_table, create_table
from tiergram.format.importers import open_safetensors


def _rows_list(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N1,N2,... got {text!r}") from None
    if any(r <= 0 for r in rows):
        raise argparse.ArgumentTypeError(f"rows must be positive, got {text!r}")
    return rows


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("table", help="create, describe and verify table files")
    tsub = p.add_subparsers(dest="table_command", metavar="ACTION", required=True)

    c = tsub.add_parser("create", help="write a table file (random init or imported from safetensors)")
    c.add_argument("out", help="output table file")
    c.add_argument("--heads", type=int, help="number of hash heads")
    c.add_argument("--rows-per-head", type=_rows_list, help="rows of each head: N (all heads) or N1,N2,...")
    c.add_argument("--dim", type=int, help="values per row (D)")
    c.add_argument("--codec", default="fp8_e4m3", help="fp32, bf16, int8 or fp8_e4m3 (default)")
    add_common(c, "--seed", seed="seed of the random N(0, std^2) init")
    c.add_argument("--std", type=float, default=1.0, help="standard deviation of the random init")
    c.add_argument("--page-size", type=int, default=4096)
    c.add_argument("--layer-id", type=int, default=None, help="the Engram layer this table serves")
    c.add_argument("--from-safetensors", metavar="FILE", help="import values from a safetensors checkpoint")
    c.add_argument("--tensor", metavar="NAME", help="tensor [N_total, D], or a name with {head} for per-head tensors")
    add_common(c, "--quiet")
    c.set_defaults(func=cmd_create)

    i = tsub.add_parser("info", help="print a table file's manifest and geometry")
    i.add_argument("file")
    add_common(i, "--json", json="print the manifest as JSON")
    i.set_defaults(func=cmd_info)

    v = tsub.add_parser("verify", help="check every page checksum; exit 0 when sound, 1 listing bad pages",
                        description="Check the header, the manifest, the file size and every page checksum. Exit "
                                    "status 0: sound; 1: bad pages (listed on stderr); 2: the file cannot be opened "
                                    "as a table (bad magic, version, header or manifest checksum, inconsistent "
                                    "manifest, or a size other than data_offset + n_pages * page_size).")
    v.add_argument("file")
    add_common(v, "--quiet")
    v.set_defaults(func=cmd_verify)

    sh = tsub.add_parser("shm", help="list this user's shared /dev/shm table copies; --clean removes them")
    sh.add_argument("--clean", action="store_true", help="remove them (processes mapping one keep it until exit)")
    sh.set_defaults(func=cmd_shm)

    ps = tsub.add_parser("push", help="put a table file into Mooncake Store (docs/remote.md); prints its URI")
    ps.add_argument("file")
    ps.add_argument("--master", required=True, metavar="HOST:PORT", help="the mooncake_master's RPC address")
    ps.add_argument("--name", help="the table's name in the store (default: the file's stem)")
    ps.add_argument("--replace", action="store_true", help="replace a copy already in the store")
    ps.add_argument("--replicas", type=int, default=1, help="copies of each page, on different holders")
    ps.add_argument("--local-hostname", default="127.0.0.1", help="this client's address as the holders see it")
    add_common(ps, "--quiet")
    ps.set_defaults(func=cmd_push)


def cmd_create(args: argparse.Namespace) -> int:
    provenance = {"tool": "tiergram table create"}
    if args.heads is not None and args.heads <= 0:  # 0 would silently mean "as many heads as --rows-per-head lists"
        raise ValueError(f"--heads must be positive, got {args.heads}")
    if args.from_safetensors:
        if not args.tensor:
            raise ValueError("--from-safetensors needs --tensor NAME")
        src = open_safetensors(args.from_safetensors, args.tensor, _expand(args.rows_per_head, args.heads), args.heads)
        if args.dim and args.dim != src.dim:
            raise ValueError(f"--dim {args.dim} disagrees with the tensor's D = {src.dim}")
        head_rows, dim, values = src.head_rows, src.dim, src.values()
        provenance.update(source=str(args.from_safetensors), tensors=src.names)
    else:
        if args.heads is None or args.rows_per_head is None or args.dim is None:
            raise ValueError("random init needs --heads, --rows-per-head and --dim")
        head_rows, dim, values = _expand(args.rows_per_head, args.heads), args.dim, None
        provenance.update(init=f"normal(0, {args.std}^2)", seed=args.seed)
    manifest = TableManifest(codec=args.codec, dim=dim, head_rows=head_rows, page_size=args.page_size,
                             layer_id=args.layer_id, provenance=provenance)
    if values is None:
        path = create_random_table(args.out, manifest, seed=args.seed, std=args.std, progress=not args.quiet)
    else:
        path = create_table(args.out, manifest, values, progress=not args.quiet)
    print(f"wrote {path}: {manifest.n_heads} heads, {manifest.total_rows} rows of {manifest.row_bytes} B "
          f"({manifest.codec}, D={dim}), {manifest.n_pages} pages")
    return 0


def _expand(rows: tuple[int, ...] | None, heads: int | None) -> tuple[int, ...] | None:
    if rows is None:
        return None
    if len(rows) == 1 and heads:
        return rows * heads
    if heads and len(rows) != heads:
        raise ValueError(f"--rows-per-head lists {len(rows)} heads but --heads is {heads}")
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    t = TableFile.open(args.file)
    m = t.manifest
    if args.json:
        print(json.dumps(m.to_json(t.data_offset), indent=2))
        return 0
    rows = sorted(set(m.head_rows))
    print(f"{t.path}\n  codec      {m.codec}, D={m.dim}, {m.row_bytes} B/row\n"
          f"  heads      {m.n_heads} (rows per head: {rows[0] if len(rows) == 1 else f'{rows[0]}..{rows[-1]}'})\n"
          f"  rows       {m.total_rows}\n  pages      {m.n_pages} x {m.page_size} B, {m.rows_per_page} rows/page\n"
          f"  data       {m.data_bytes / 2**20:.1f} MiB at offset {t.data_offset}\n"
          f"  layer      {m.layer_id}\n  hashing    {'yes' if m.hashing else 'none'}\n"
          f"  provenance {json.dumps(m.provenance)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    t = TableFile.open(args.file)
    bad = t.verify(progress=not args.quiet)
    if bad:
        print(f"{t.path}: {len(bad)} bad page(s): {' '.join(map(str, bad))}", file=sys.stderr)
        return 1
    print(f"{t.path}: all {t.manifest.n_pages} pages sound")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from tiergram.tiers.mooncake import connect, push_table  # optional dependency (the remote extra)

    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    store = connect(args.master, local_hostname=args.local_hostname)
    try:
        uri = push_table(args.file, args.master, args.name, replace=args.replace, replicas=args.replicas,
                         progress=not args.quiet, store=store)
    finally:
        store.close()
    print(uri)
    return 0


def cmd_shm(args: argparse.Namespace) -> int:
    from tiergram.tiers.host import SHM_DIR, remove_shared_copies, shared_copies

    if args.clean:
        removed = remove_shared_copies()
        print(f"removed {len(removed)} shared table cop{'y' if len(removed) == 1 else 'ies'} from {SHM_DIR}")
        return 0
    copies = shared_copies()
    for path in copies:
        print(f"{path}  {path.lstat().st_size} B")
    print(f"{len(copies)} shared table cop{'y' if len(copies) == 1 else 'ies'} of this user in {SHM_DIR}")
    return 0

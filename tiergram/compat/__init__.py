"""Drop-in replacements for other engines' table-store APIs, backed by tiergram's tiers."""

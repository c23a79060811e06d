"""Mooncake tier (docs/remote.md): `client` (URIs, keys, error codes, the shared client, bounded calls), `tier`
(the read path, pages verified on arrival), `push` (writing and removing a table)."""

from tiergram.tiers.mooncake.client import (
    OBJECT_NOT_FOUND,
    Caller,
    connect,
    error_name,
    fetch_manifest,
    lower_thread_priority,
    manifest_key,
    page_key,
    parse_manifest_blob,
    parse_uri,
    table_uri,
)
from tiergram.tiers.mooncake.push import (
    ensure_pushed,
    manifest_blob,
    page_digest,
    push_table,
    pushed_name,
    remove_table,
    table_keys,
)
from tiergram.tiers.mooncake.tier import MooncakeTier, PageReadError

__all__ = ["OBJECT_NOT_FOUND", "Caller", "MooncakeTier", "PageReadError",
           "connect", "ensure_pushed", "error_name", "fetch_manifest", "lower_thread_priority",
           "manifest_blob", "manifest_key", "page_digest", "page_key", "parse_manifest_blob", "parse_uri",
           "push_table", "pushed_name", "remove_table", "table_keys", "table_uri"]

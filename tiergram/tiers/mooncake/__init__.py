"""Mooncake tier: a table's pages as objects in Mooncake Store, fetched into registered buffers and verified.

One object per page (`tiergram/<name>/p<page>`), the header and manifest in `tiergram/<name>/manifest`, written
last by `push_table` as the commit marker. A read fetches every distinct page it needs in one `batch_get_into`
into a registered, page-aligned staging buffer, then checks each page's trailer (index and CRC-32C) with the
same native check the file reader uses: a remote store is trusted less than a local disk. Any page that cannot
be read correctly raises `PageReadError` naming the table, the page and Mooncake's error code, within the
tier's timeout — never wrong rows. docs/remote.md explains the deployment and the measurements behind the
object granularity. `client`: URIs, keys, error codes, the shared client and bounded calls; `tier`: the read
path; `push`: writing and removing a table.
"""

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

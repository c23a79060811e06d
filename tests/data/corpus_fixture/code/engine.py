def fetch_rows(table, row_ids, cache):
    out = []
    for rid in row_ids:
        row = cache.get(rid)
        if row is None:
            row = table[rid]
            cache[rid] = row
        out.append(row)
    return out


def hit_rate(hits, misses):
    total = hits + misses
    return hits / total if total else 0.0

"""Imports point down: every module imports only its own package or a lower layer of docs/design.md, and no
module imports another package's private (`_name`) attribute or module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tiergram"
ANYWHERE = {"_native"}  # the package's own compiled core: every layer may call it
TOP = {"__init__", "__main__"}  # tiergram/__init__.py (version only) and `python -m tiergram` (calls cli)


def layer_table() -> dict[str, int]:
    """{package: layer number} from the fenced block between the layer markers of docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"<!-- layers: begin.*?```\n(.*?)```\s*<!-- layers: end -->", text, re.S)
    assert block, "docs/design.md has no layer table between '<!-- layers: begin' and '<!-- layers: end -->'"
    table: dict[str, int] = {}
    for line in block.group(1).splitlines():
        m = re.match(r"(\d+)\s+((?:[a-z_]+ )*[a-z_]+)\s{2,}", line)
        assert m, f"docs/design.md layer line not understood: {line!r}"
        for name in m.group(2).split():
            table[name] = int(m.group(1))
    return table


def owner(module: str) -> str:
    """The top-level unit of a dotted module name under tiergram ('tiergram.store.table' -> 'store')."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every tiergram import in a file, relative ones resolved."""
    pkg = path.relative_to(root).with_suffix("").parts[:-1]  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "tiergram"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            if module.split(".")[0] == "tiergram":
                out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_package_has_a_layer() -> None:
    """A new package must be placed in docs/design.md's layer table before it can be checked."""
    table = layer_table()
    units = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in modules()}
    missing = sorted(units - set(table) - ANYWHERE - TOP)
    assert not missing, f"packages with no layer in docs/design.md's table: {missing} (add them there)"


def test_imports_point_down() -> None:
    """Each import reaches its own package or a strictly lower layer (packages in one layer are independent)."""
    table = layer_table()
    bad = []
    for path in modules():
        here = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if here in TOP or here not in table:
            continue
        for line, module, names in imports(path):
            targets = [owner(module)] if owner(module) else list(names)  # `from tiergram import x`
            for there in targets:
                if there in ANYWHERE or there == here or there == "__version__":
                    continue
                if there not in table or table[there] >= table[here]:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {here} (layer {table[here]}) imports {module} "
                               f"({there}, layer {table.get(there, '?')})")
    assert not bad, "imports that do not point down (docs/design.md, 'Layers'):\n" + "\n".join(bad)


def test_no_private_names_across_packages() -> None:
    """No module imports a `_name` (attribute or module) that belongs to another package."""
    bad = []
    for path in modules():
        here = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for line, module, names in imports(path):
            there = owner(module)
            if there == here:
                continue
            private = [m for m in module.split(".")[1:] if m.startswith("_") and m not in ANYWHERE | TOP]
            private += [n for n in names if n.startswith("_") and n not in ANYWHERE and not n.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {', '.join(private)}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_checker_sees_a_violation(tmp_path) -> None:
    """The import walk resolves relative imports and finds upward ones (a checker that sees nothing passes all)."""
    pkg = tmp_path / "tiergram" / "store"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from ..engine import llm_engine\nfrom .table import _private\n"
                              "from tiergram.kernels.gather import _hidden\n")
    got = imports(pkg / "x.py", root=tmp_path)
    assert [(m, n) for _, m, n in got] == [("tiergram.engine", ["llm_engine"]), ("tiergram.store.table", ["_private"]),
                                           ("tiergram.kernels.gather", ["_hidden"])]
    table = layer_table()
    assert table["engine"] > table["store"] and table["kernels"] < table["store"]


def test_plan_imports_nothing_from_bench() -> None:
    """The planner reads specs, sweep JSON and measurement JSON and fits them: `bench` measures, `plan` never
    imports it (docs/design.md puts plan below bench)."""
    got = [f"{path.relative_to(ROOT)}:{line}: {module} {names}"
           for path in sorted((PACKAGE / "plan").rglob("*.py"))
           for line, module, names in imports(path)
           if owner(module) == "bench" or (module == "tiergram" and "bench" in names)]
    assert not got, "plan imports bench:\n" + "\n".join(got)
    assert layer_table()["plan"] < layer_table()["bench"]

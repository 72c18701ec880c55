"""Installed-version checks for the Triton kernels (read once at import, never in forward).

Triton's CPU interpreter (``TRITON_INTERPRET=1``, how the kernels run without a GPU) before
triton 3.7 turns one-element numpy arrays into Python ints with ``int()``, which numpy 2.4
refuses: every interpreted kernel then dies with ``InterpreterError: TypeError('only
0-dimensional arrays can be converted to Python scalars')`` (measured with triton 3.6.0 and
numpy 2.4 / 2.5; 3.7.0 and 3.8 squeeze the array first and pass). Package metadata cannot tie
numpy's version to triton's, so the Triton backend checks the pair and names the fix.
Compiled GPU kernels are not affected.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional

# The first triton whose interpreter works with numpy >= 2.4, and that numpy.
FIXED_TRITON = (3, 7)
STRICT_NUMPY = (2, 4)


def _release(version: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of a version string such as '3.6.0' or '2.4.0rc1'; None if absent."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def interpreter_problem(triton_version: Optional[str],
                        numpy_version: Optional[str]) -> Optional[str]:
    """Why Triton's interpreter cannot run the kernels with these installed versions (the
    message names the fix), or None when it can. No triton: nothing to interpret."""
    triton_release = _release(triton_version)
    if triton_release is None:
        return None
    if _release(numpy_version) is None:
        return (f"Triton's CPU interpreter (TRITON_INTERPRET=1) needs numpy, which is not "
                f"installed: pip install numpy")
    if triton_release < FIXED_TRITON and _release(numpy_version) >= STRICT_NUMPY:
        return (f"triton {triton_version}'s CPU interpreter (TRITON_INTERPRET=1) fails with "
                f"numpy {numpy_version} (numpy >= 2.4 no longer converts one-element arrays "
                f"to int; fixed in triton 3.7): pip install 'numpy<2.4', or triton >= 3.7")
    return None

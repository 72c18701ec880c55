"""The wheel's packages, derived from the source tree (pyproject.toml holds everything else).

The import package ``varlen_cp`` lives in ``plugin/`` and ``varlen_cp.kernels`` in
``kernels/``. setuptools' automatic discovery cannot rename folders, and a hand-written list
went stale once already (the 0.1.0 wheel lacked ``varlen_cp.tables``, so ``import
varlen_cp`` failed from it); here every folder with an ``__init__.py`` under those two roots
is a package. ``tests/package/test_packaging.py`` builds the wheel and checks that it holds every
source file and that each module imports from it.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {"varlen_cp": "plugin", "varlen_cp.kernels": "kernels"}


def derived_packages() -> list[str]:
    """Every package under each root, named by the root's import name."""
    names = []
    for name, folder in PACKAGE_DIRS.items():
        names.append(name)
        names += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return sorted(set(names))


setup(package_dir=PACKAGE_DIRS, packages=derived_packages())

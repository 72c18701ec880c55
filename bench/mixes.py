"""The benchmarks' document-length mixes: moved into the package as ``varlen_cp.mixes``
(``varlen-cp-plan --mix NAME`` uses them); re-exported here so that ``from mixes import
...`` in bench/ and ``from bench.mixes import ...`` in the tests keep working."""

from varlen_cp.mixes import (MIXES, TOTAL, fill, lognormal, lognormal_1k,  # noqa: F401
                             lognormal_docs)

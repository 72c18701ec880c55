"""``python -m varlen_cp.train``: an alias of ``python -m varlen_cp.integrations.torchtitan.train``
(the torchtitan launcher, which lives with its integration), kept so that existing job
scripts keep working. No torchtitan import
here: a missing torchtitan is reported by the launcher, with the extra to install."""

import sys

from .integrations.torchtitan.train import USAGE, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())

"""Where the tests find the shared test data (tokenizers, the C4 sample, eval tasks): one setting.

OLMO_DS_SHARED points at it; by default it is `shared/` beside the repository, as on the development
machines. A GPU host that carries the data inside the checkout sets OLMO_DS_SHARED=$PWD/shared.
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OLMO_DS_SHARED") or ROOT.parent / "shared").resolve()

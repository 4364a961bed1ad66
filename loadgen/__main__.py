"""``python -m loadgen``: the ``inferq loadgen`` command on its own (see :mod:`loadgen.cli`).

python -m loadgen --url http://127.0.0.1:8000 --model digits -c 16 -d 10s
python -m loadgen --model digits --rate 100:1000:10s --report run.html --png run.png
"""

from __future__ import annotations

import sys

from loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())

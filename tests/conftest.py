import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MIRAGE_SERVE_CHECK", "1")
sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MUGRAPHS = SHARED / "mirage-mugraphs"

# `python -m pytest` puts the checkout first on sys.path, so its mirage_serve/ is imported even
# after a non-editable `pip install .`; pyproject's package-dir maps models/ and kernel_cache/
# into that package, so map them the same way when the installed layout is not what we got.
if importlib.util.find_spec("mirage_serve.models") is None:
    import mirage_serve

    mirage_serve.__path__.append(str(Path(__file__).resolve().parents[1]))

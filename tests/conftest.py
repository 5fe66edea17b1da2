import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MIRAGE_SERVE_CHECK", "1")
sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MUGRAPHS = SHARED / "mirage-mugraphs"

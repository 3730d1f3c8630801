"""The HTML report in a real headless browser (Debian's chromium): it loads,
the DOM has the matrix, and the screenshot shows the verdict colours."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from conformance.report import write
from tests.self.test_report import build, session_with_findings

pytestmark = pytest.mark.selfcheck

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable") if shutil.which(b)), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH (Debian: apt-get install chromium; ci/setup.sh installs it)")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]
# the badges' colours in templates/report.html.j2
FAIL_RED, PASS_GREEN, KNOWN_BROWN, SKIP_GREY = (0xCF, 0x22, 0x2E), (0x1A, 0x7F, 0x37), (0x9A, 0x67, 0x00), (0x6E, 0x77, 0x81)


def browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args], capture_output=True, text=True, timeout=120)


def png_pixels(path: Path) -> tuple[int, int, set[tuple[int, int, int]]]:
    """(width, height, the set of RGB colours) of an 8-bit RGB / RGBA PNG."""
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, b"", None
    while pos < len(blob):
        (n,), kind = struct.unpack(">I", blob[pos:pos + 4]), blob[pos + 4:pos + 8]
        chunk = blob[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + n
    width, height, depth, ctype, _, _, interlace = head
    assert depth == 8 and ctype in (2, 6) and interlace == 0, head
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    prev, colours, i = bytearray(stride), set(), 0
    for _ in range(height):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        colours.update(tuple(line[x:x + 3]) for x in range(0, stride, bpp))
        prev = line
    return width, height, colours


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    write.write_all(build([session_with_findings().to_dict()]), out)
    return out


@needs_browser
def test_the_page_loads_with_its_matrix_and_findings(report_dir, tmp_path):
    proc = browser(tmp_path, "--dump-dom", (report_dir / "report.html").as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert '<table id="matrix">' in dom
    for text in ("WRAP-UNITS", "FSDP2-GROUPS", "fsdp2", "known failure <code>tie-below-lca</code>", "Standalone torch-only repro"):
        assert text in dom, text
    assert dom.count('class="v v-FAIL"') >= 2 and 'class="v v-SKIP"' in dom  # matrix cells and the legend


@needs_browser
def test_the_screenshot_shows_each_verdict(report_dir, tmp_path):
    shot = tmp_path / "report.png"
    proc = browser(tmp_path, "--window-size=1280,1400", f"--screenshot={shot}", (report_dir / "report.html").as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    width, height, colours = png_pixels(shot)
    assert (width, height) == (1280, 1400)
    for name, rgb in (("FAIL", FAIL_RED), ("PASS", PASS_GREEN), ("KNOWN", KNOWN_BROWN), ("SKIP", SKIP_GREY)):
        assert rgb in colours, f"no {name} badge colour {rgb} in the screenshot"
    assert len(colours) > 50  # text was rendered, not a blank page

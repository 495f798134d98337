"""control/pipeline.py: the device config a push carries. A Tofino build's folder is packed
as bf_switchd's P4Runtime server (bf-drivers' PI implementation) reads it, and read back
here by a small C reader that walks it as that code does (a uint32 size in the host's
little-endian order, then the bytes, three times); BMv2's JSON goes as it is."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ina_collectives.control import pipeline
from ina_collectives.errors import ControlError

READER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* Walk a Tofino device config: [size][program name][size][binary][size][context]. */
int main(int argc, char **argv) {
  FILE *f = fopen(argv[1], "rb");
  if (!f) return 2;
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  const char *p = buf, *end = buf + n;
  const char *names[3] = {"program", "binary", "context"};
  for (int i = 0; i < 3; i++) {
    uint32_t size;
    if (p + sizeof size > end) return 3;
    memcpy(&size, p, sizeof size);
    p += sizeof size;
    if (p + size > end) return 4;
    if (i == 0) printf("%s %.*s\n", names[i], (int)size, p);
    else printf("%s %u %02x\n", names[i], size, size ? (unsigned char)p[size - 1] : 0);
    p += size;
  }
  return p == end ? 0 : 5;
}
"""


def tofino_folder(root: Path, chip: str = "tofino", conf: bool = True) -> Path:
    """A folder laid out as p4c-barefoot -o writes one: the .conf, pipe/<chip>.bin,
    pipe/context.json, and the P4Info asked for beside them."""
    out = root / "build"
    (out / "pipe").mkdir(parents=True)
    (out / "pipe" / f"{chip}.bin").write_bytes(bytes(range(256)) * 5 + b"\x7f")
    (out / "pipe" / "context.json").write_text('{"program_name": "ina_aggregator_tna"}')
    (out / "p4info.txt").write_text("# a P4Info\n")
    if conf:
        (out / "ina_aggregator_tna.conf").write_text(json.dumps({"p4_devices": [{
            "device-id": 0, "p4_programs": [{
                "program-name": "ina_aggregator_tna", "bfrt-config": "bf-rt.json",
                "p4_pipelines": [{"p4_pipeline_name": "pipe",
                                  "config": f"pipe/{chip}.bin",
                                  "context": "pipe/context.json"}]}]}]}))
    return out


def test_a_packed_config_reads_back_field_by_field():
    data = pipeline.pack_tofino("prog", b"\x00\x01bin", b"{}")
    assert data[:4] == (4).to_bytes(4, "little") and data[4:8] == b"prog"
    back = pipeline.unpack_tofino(data)
    assert (back.program, back.binary, back.context) == ("prog", b"\x00\x01bin", b"{}")
    for bad, what in ((data[:-1], "claims 2 bytes"), (data + b"x", "1 bytes after"),
                      (data[:6], "claims 4 bytes"), (b"", "before the program name")):
        with pytest.raises(ControlError, match=what):
            pipeline.unpack_tofino(bad)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the C reader")
@pytest.mark.parametrize("chip", ["tofino", "tofino2"])
def test_a_tofino_folder_is_packed_as_the_c_reader_walks_it(tmp_path, chip):
    folder = tofino_folder(tmp_path, chip)
    assert pipeline.target_of(folder) == chip
    found = pipeline.find_tofino_build(folder)
    assert (found.program, found.p4info) == ("ina_aggregator_tna", folder / "p4info.txt")
    config = tmp_path / "config.bin"
    config.write_bytes(pipeline.device_config(folder, chip))
    (tmp_path / "reader.c").write_text(READER)
    subprocess.run(["gcc", "-O1", "-o", str(tmp_path / "reader"), str(tmp_path / "reader.c")],
                   check=True)
    walked = subprocess.run([str(tmp_path / "reader"), str(config)], capture_output=True,
                            text=True)
    assert walked.returncode == 0, walked
    assert walked.stdout.splitlines() == [
        "program ina_aggregator_tna", "binary 1281 7f",
        f"context {len((folder / 'pipe' / 'context.json').read_bytes())} 7d"]


def test_a_folder_without_a_conf_is_read_from_pipe(tmp_path):
    folder = tofino_folder(tmp_path, "tofino2", conf=False)
    found = pipeline.find_tofino_build(folder)
    assert (found.chip, found.program, found.binary.name) == ("tofino2", "build",
                                                              "tofino2.bin")


def test_what_is_missing_or_for_another_target_is_named(tmp_path):
    folder = tofino_folder(tmp_path)
    with pytest.raises(ControlError, match="is a tofino build, not for tofino2"):
        pipeline.device_config(folder, "tofino2")
    (folder / "pipe" / "context.json").unlink()
    with pytest.raises(ControlError, match="not a Tofino build: no context.json"):
        pipeline.find_tofino_build(folder)
    bmv2 = tmp_path / "prog.json"
    bmv2.write_text('{"parsers": [], "pipelines": []}')
    assert pipeline.device_config(bmv2, "bmv2") == bmv2.read_bytes()
    with pytest.raises(ControlError, match="is a bmv2 build, not for tofino; a Tofino build "
                                           "is the compiler's output folder"):
        pipeline.device_config(bmv2, "tofino")

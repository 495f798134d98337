"""What a P4Runtime push carries as the target's device config (``p4_device_config``):
BMv2's JSON as p4c-bm2-ss wrote it, or a Tofino build (the Tofino compiler's output
folder) packed as bf_switchd's P4Runtime server, bf-drivers' PI implementation, reads it:
three fields in order, each a 32-bit little-endian byte count and then the bytes: the
program's name, the pipeline's binary (``tofino.bin`` or ``tofino2.bin``) and its
``context.json``. (One pipeline profile: the program runs in every pipe.)"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ControlError

TARGETS = ("bmv2", "tofino", "tofino2")
_SIZE = struct.Struct("<I")


@dataclass(frozen=True)
class TofinoOutput:
    """A Tofino compiler's output, as found in its folder (``find_tofino_build``)."""
    chip: str           # "tofino" or "tofino2": the compiler's --target
    program: str        # the program's name, as bf_switchd knows it
    binary: Path        # pipe/tofino.bin (or tofino2.bin)
    context: Path       # pipe/context.json
    p4info: Path | None  # the P4Info the compiler wrote beside them, if it is there


@dataclass(frozen=True)
class TofinoConfig:
    """A packed Tofino device config, read back (``unpack_tofino``)."""
    program: str
    binary: bytes
    context: bytes


def pack_tofino(program: str, binary: bytes, context: bytes) -> bytes:
    """The device config bf-drivers' PI reads: name, binary, context, each size-prefixed."""
    out = bytearray()
    for field in (program.encode(), binary, context):
        out += _SIZE.pack(len(field)) + field
    return bytes(out)


def unpack_tofino(data: bytes) -> TofinoConfig:
    """A packed Tofino device config's three fields, read in order as bf-drivers reads
    them; ControlError where a size runs past the end or bytes are left over."""
    fields, at = [], 0
    for name in ("program name", "binary", "context"):
        if at + _SIZE.size > len(data):
            raise ControlError(f"the Tofino device config ends before the {name}'s size "
                               f"(at byte {at} of {len(data)})")
        (size,), at = _SIZE.unpack_from(data, at), at + _SIZE.size
        if at + size > len(data):
            raise ControlError(f"the Tofino device config's {name} claims {size} bytes; "
                               f"{len(data) - at} are left")
        fields.append(data[at:at + size])
        at += size
    if at != len(data):
        raise ControlError(f"the Tofino device config has {len(data) - at} bytes after "
                           f"its context")
    return TofinoConfig(fields[0].decode(), fields[1], fields[2])


def find_tofino_build(folder: str | Path) -> TofinoOutput:
    """The Tofino compiler's output in ``folder`` (``p4c-barefoot -o folder``, then
    ``bfas``): its ``.conf`` names the program and the pipeline's files; without one,
    ``manifest.json`` names the program and ``pipe/`` holds the files. ControlError
    naming what is missing."""
    folder = Path(folder)
    confs = sorted(folder.glob("*.conf"))
    program, binary, context = folder.name, None, None
    if confs:
        try:
            conf = json.loads(confs[0].read_text())
            entry = conf["p4_devices"][0]["p4_programs"][0]
            pipe = entry["p4_pipelines"][0]
            program = entry["program-name"]
            binary, context = folder / pipe["config"], folder / pipe["context"]
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ControlError(f"{confs[0]} is not the Tofino compiler's program "
                               f"description: {exc!r}") from None
        if not (binary.is_file() and context.is_file()):  # (paths relative to elsewhere)
            binary, context = folder / "pipe" / binary.name, folder / "pipe" / context.name
    else:
        try:  # (the compiler's manifest names the program)
            manifest = json.loads((folder / "manifest.json").read_text())
            program = manifest["programs"][0]["program_name"].removesuffix(".p4")
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            pass
        found = [p for p in (folder / "pipe" / "tofino.bin", folder / "pipe" / "tofino2.bin")
                 if p.is_file()]
        binary = found[0] if found else folder / "pipe" / "tofino.bin"
        context = folder / "pipe" / "context.json"
    for path, what in ((binary, "the pipeline's binary"), (context, "context.json")):
        if not path.is_file():
            raise ControlError(f"{folder} is not a Tofino build: no {what} ({path})")
    chip = "tofino2" if binary.name.startswith("tofino2") else "tofino"
    p4info = next((p for p in (folder / "p4info.txt", folder / f"{program}.p4info.txt")
                   if p.is_file()), None)
    return TofinoOutput(chip, program, binary, context, p4info)


def target_of(device_config: str | Path) -> str:
    """Which kind of target a device config is for: "tofino" or "tofino2" for a Tofino
    build's folder, else "bmv2" (a file, pushed as it is)."""
    path = Path(device_config)
    return find_tofino_build(path).chip if path.is_dir() else "bmv2"


def device_config(path: str | Path, target: str | None = None) -> bytes:
    """The bytes to push for ``path``: a Tofino build's folder packed, or a file as it is.
    ``target``: what the caller expects ("bmv2", "tofino", "tofino2"; None: any);
    ControlError if the build is for another."""
    path = Path(path)
    found = target_of(path)
    if target is not None and target != found:
        raise ControlError(f"{path} is a {found} build, not for {target}"
                           + ("; a Tofino build is the compiler's output folder"
                              if found == "bmv2" else ""))
    if found == "bmv2":
        return path.read_bytes()
    build = find_tofino_build(path)
    return pack_tofino(build.program, build.binary.read_bytes(), build.context.read_bytes())

"""The Tofino programs through the open Tofino compiler: find it, compile (cached), read
what it wrote (the P4Info, its resource figures).

    compiler = find_compiler()                 # None, with missing_compiler() saying why
    build = compile_tofino("tna")              # p4c-barefoot --target tofino --arch tna
    build.p4info, build.out, build.log         # the P4Info text, its output folder, stderr
    build.resources()                          # its figures per stage, and the PHV's

    python -m ina_collectives.testing.tofino tna t2na   # p4/README.md's resource tables

The compiler is p4c 1.2.5.16's ``p4c-barefoot`` (backends/tofino), looked for on PATH,
then in ``$P4TOOLS_DIR/tofino/bin`` (default ``/opt/p4tools``, where
``../shared/p4-toolchain/build.sh tofino`` installs it). This module only runs it. A
build is the program ``p4/gen.py --arch tna|t2na`` writes; it is compiled once per text
of the program and compiler version, into ``$INA_P4_CACHE`` (default
``~/.cache/ina-collectives/p4``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..control import schema as S
from .bmv2 import ROOT, tools_dir

COMPILER = "p4c-barefoot"
TARGETS = {build.arch: build.chip for build in S.TOFINO.values()}  # arch -> --target


def tna_module():
    """p4/tna.py, the Tofino program's generator (a file of the checkout, not a package:
    ``p4`` is p4runtime's package name)."""
    spec = importlib.util.spec_from_file_location("ina_p4_tna", ROOT / "p4" / "tna.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Compiler:
    path: str
    env: dict


def find_compiler() -> Compiler | None:
    """p4c-barefoot, or None where it is missing."""
    env = dict(os.environ)
    found = shutil.which(COMPILER)
    base = tools_dir() / "tofino"
    if found is None:
        candidate = base / "bin" / COMPILER
        if candidate.is_file() and os.access(candidate, os.X_OK):
            found = str(candidate)
    if found is None:
        return None
    lib = base / "lib"
    if lib.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    # (it runs the C preprocessor, and bf-p4c finds tna.p4 beside itself)
    return Compiler(found, env)


def missing_compiler() -> str:
    return (f"needs the open Tofino compiler ({COMPILER}) on PATH or in "
            f"{tools_dir()}/tofino/bin (../shared/p4-toolchain/build.sh tofino, or set "
            f"P4TOOLS_DIR)")


@dataclass(frozen=True)
class TofinoBuild:
    arch: str
    target: str
    program: Path   # the program compiled (p4/ina_aggregator_<arch>.p4)
    out: Path       # the compiler's output folder (pipe/: the .bfa, context.json, the binary)
    p4info: Path    # the P4Info text it wrote
    log: str        # its stdout and stderr, then the assembler's

    def stages(self) -> int:
        """The ingress stages the program uses (from the assembly)."""
        bfa = (self.out / "pipe" / f"{self.program.stem}.bfa").read_text()
        return len(set(re.findall(r"^stage (\d+) ingress:", bfa, re.M)))

    def stateful_alus(self) -> int:
        """The stateful ALUs (one per register) the program uses."""
        bfa = (self.out / "pipe" / f"{self.program.stem}.bfa").read_text()
        return len(re.findall(r"^  stateful ", bfa, re.M))

    def resources(self) -> dict:
        """The compiler's own figures (``-g``: pipe/logs/resources.json and phv.json), each
        a (used, in the chip) pair: per MAU stage (``stages``, in order) its SRAM, TCAM
        and map RAM blocks, its stateful ALUs and logical tables (used only); the PHV's
        containers (``phv``) by kind ("normal", and Tofino's tag-along or Tofino 2's
        mocha and dark ones) and width in bits."""
        logs = self.out / "pipe" / "logs"
        mau = json.loads((logs / "resources.json").read_text())["resources"]
        stages = []
        for s in sorted(mau["mau"]["mau_stages"], key=lambda s: s["stage_number"]):
            rams, tcams, maps = s["rams"], s["tcams"], s["map_rams"]
            stages.append({
                "stage": s["stage_number"],
                "sram": (len(rams["srams"]), rams["nRows"] * rams["nColumns"]),
                "tcam": (len(tcams["tcams"]), tcams["nRows"] * tcams["nColumns"]),
                "map_ram": (len(maps["maprams"]), maps["nRows"] * maps["nUnits"]),
                "stateful_alus": (len(s["meter_alus"]["meters"]), s["meter_alus"]["nAlus"]),
                "tables": len(s["logical_tables"]["ids"])})
        have: Counter = Counter()
        for kind, groups in mau["phv_containers"].items():
            for group in groups:
                have[kind, group["width"]] += group["units"]
        used = Counter((c["container_type"], c["bit_width"])
                       for c in json.loads((logs / "phv.json").read_text())["containers"])
        phv: dict[str, dict[int, tuple[int, int]]] = {}
        for kind, width in sorted(have):
            phv.setdefault(kind, {})[width] = (used[kind, width], have[kind, width])
        return {"stages": stages, "phv": phv}


def resource_table(build: TofinoBuild) -> str:
    """``build``'s resources() as p4/README.md gives them: a row per MAU stage, then the
    PHV's containers."""
    r = build.resources()
    lines = [f"{TARGETS[build.arch]} (`{build.arch}`), per MAU stage (used of the stage's):",
             "", "| stage | SRAM blocks | TCAM blocks | map RAMs | stateful ALUs | tables |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in r["stages"]:
        lines.append(f"| {s['stage']} | " + " | ".join(
            f"{s[key][0]} of {s[key][1]}" for key in ("sram", "tcam", "map_ram",
                                                      "stateful_alus"))
            + f" | {s['tables']} |")
    total = {key: sum(s[key][0] for s in r["stages"])
             for key in ("sram", "tcam", "map_ram", "stateful_alus")}
    lines.append(f"| all {len(r['stages'])} | {total['sram']} | {total['tcam']} | "
                 f"{total['map_ram']} | {total['stateful_alus']} | "
                 f"{sum(s['tables'] for s in r['stages'])} |")
    phv = "; ".join(f"{kind}: " + ", ".join(f"{u} of {h} x {w} bits"
                                            for w, (u, h) in widths.items())
                    for kind, widths in r["phv"].items())
    lines += ["", f"PHV containers used: {phv}."]
    return "\n".join(lines) + "\n"


_lock = threading.Lock()


def compile_tofino(arch: str, compiler: Compiler | None = None,
                   cache: Path | None = None) -> TofinoBuild:
    """p4c-barefoot --target tofino[2] --arch tna|t2na on the committed program, with
    P4Runtime files; RuntimeError with its messages if it fails."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise FileNotFoundError(missing_compiler())
    target = TARGETS[arch]
    program = ROOT / "p4" / f"ina_aggregator_{arch}.p4"
    source = program.read_text()
    version = subprocess.run([compiler.path, "--version"], env=compiler.env,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    arguments = compile_arguments(arch, "OUT", program)
    key = hashlib.sha256(f"{version}\n{arguments}\n{source}".encode()).hexdigest()[:20]
    cache = cache or Path(os.environ.get("INA_P4_CACHE",
                                         Path.home() / ".cache" / "ina-collectives" / "p4"))
    where = cache / f"{arch}-{key}"
    build = TofinoBuild(arch, target, program, where / "out", where / "out" / "p4info.txt",
                        (where / "log.txt").read_text() if (where / "log.txt").is_file()
                        else "")
    with _lock:
        if build.p4info.is_file() and (where / "log.txt").is_file():
            return build
        work = where.with_name(where.name + f".tmp{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        (work / "out").mkdir(parents=True)
        proc = subprocess.run([compiler.path, *compile_arguments(arch, work / "out",
                                                                 program)],
                              env=compiler.env, capture_output=True, text=True, timeout=900)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"{COMPILER} --target {target} --arch {arch} failed "
                               f"({proc.returncode}) on {program}:\n{log[-6000:]}")
        # The assembler makes the pipeline's binary, and refuses a program that uses more
        # stages than the chip has: what "fitted" means here.
        pipe = work / "out" / "pipe"
        asm = subprocess.run([str(Path(compiler.path).with_name("bfas")), "--no-warn",
                              "--target", target, "--table-handle-offset0", "-o", str(pipe),
                              str(pipe / f"{program.stem}.bfa")],
                             env=compiler.env, capture_output=True, text=True, timeout=300)
        log += asm.stdout + asm.stderr
        if asm.returncode != 0:
            raise RuntimeError(f"bfas --target {target} refused {program.stem}.bfa "
                               f"({asm.returncode}):\n{(asm.stdout + asm.stderr)[-3000:]}")
        (work / "log.txt").write_text(log)
        shutil.rmtree(where, ignore_errors=True)
        work.rename(where)
    return TofinoBuild(arch, target, program, where / "out", where / "out" / "p4info.txt",
                       log)


def compile_arguments(arch: str, out: Path | str, program: Path | str | None = None
                      ) -> list[str]:
    """The compiler's arguments for ``arch`` into folder ``out``, its P4Info inside (the
    folder ina-run's --device-config takes; p4/README.md quotes them, from the checkout's
    root); ``program``: the source (default p4/ina_aggregator_<arch>.p4). The P4Info
    names registers and counters as P4Runtime's own entities, not Tofino's externs:
    what p4runtime-shell, and so the controller, reads and writes; ``-g`` writes the
    compiler's resource logs (``TofinoBuild.resources``)."""
    return ["-g", "--target", TARGETS[arch], "--arch", arch, "-o", str(out),
            "--p4runtime-files", f"{out}/p4info.txt", "--p4runtime-force-std-externs",
            str(program or f"p4/ina_aggregator_{arch}.p4")]


def main(argv: list[str] | None = None) -> int:
    """Compile each architecture named (tna, t2na) and print its resource table."""
    arches = (argv if argv is not None else sys.argv[1:]) or sorted(TARGETS)
    unknown = [a for a in arches if a not in TARGETS]
    if unknown:
        print(f"unknown architecture(s) {unknown}: one of {sorted(TARGETS)}", file=sys.stderr)
        return 2
    for arch in arches:
        print(resource_table(compile_tofino(arch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

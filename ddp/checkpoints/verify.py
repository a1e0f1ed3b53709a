"""Every checkpoint verified before it is trusted: a flipped bit is caught, not loaded.

torch.load never checks the CRC-32 that torch.save writes for every record of its zip file (PyTorch
builds miniz with the checks off, pytorch/pytorch#126952), so a checkpoint file's records are checked
here, against those CRCs. A sharded checkpoint (strategy=fsdp's dir) gets a manifest when its save
completes, `digests.json`: each file's size and CRC-32, each rank's shards hashed by the rank that
wrote them. What carries no digest (a file saved with torch's CRCs turned off, a sharded dir saved
before manifests existed, safetensors or another format) loads as before, reported as unverified.

    python -m ddp.checkpoints.verify <run dir or checkpoint>   # or: make verify CKPT=<...>

names each checkpoint as good, corrupt or unverified, and exits 1 if one is corrupt.
"""

import json
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

DIGESTS = "digests.json"  # in a sharded checkpoint's dir: {file name: {"size": bytes, "crc32": "<8 hex digits>"}}
CHUNK_BYTES = 16 * 2**20
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip record's local header: its name and extra field come after it


VERDICT = "--verdict"  # `python verify.py --verdict <file>`: prints good, unverified or `corrupt <what>`


class Corrupt(Exception):
    """A checkpoint whose bytes changed after it was saved; the message says where."""


def file_crc32(path: Path) -> int:
    """The CRC-32 of a whole file."""
    with open(path, "rb", buffering=0) as file:
        return crc32_of(file, 0, None, bytearray(CHUNK_BYTES))


def crc32_of(file, start: int, length: int | None, buffer: bytearray) -> int:
    """The CRC-32 of `length` bytes of an open file from `start` (to its end if None), read in chunks of `buffer`'s
    size (one buffer for every record of a file: a new one per record zeroed 16 MB each time, seconds for a model
    of a thousand tensors)."""
    crc, view = 0, memoryview(buffer)
    file.seek(start)
    left = length if length is not None else float("inf")
    while left > 0:
        read = file.readinto(view[:int(min(left, len(buffer)))])
        if not read:
            break
        crc = zlib.crc32(view[:read], crc)
        left -= read
    return crc


def verify_file(path: Path) -> bool:
    """Checks every record of a torch.save file against the CRC-32 its zip header gives; True when every
    record was checked, False when the file can't be (not a zip, or saved with CRCs turned off: a record
    of data with CRC 0). A record that fails raises Corrupt, naming it."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        with open(path, "rb") as file:
            if file.read(4) == b"PK\x03\x04":  # a zip file, so torch.save's, whose directory is damaged or cut off
                raise Corrupt("its zip directory is unreadable (damaged, or the file was cut short)") from None
        return False  # torch's legacy format, safetensors, or another
    with archive:
        records = archive.infolist()
    checked, buffer = True, bytearray(CHUNK_BYTES)
    with open(path, "rb", buffering=0) as file:
        for record in records:
            if record.CRC == 0 and record.file_size > 0 or record.compress_type != zipfile.ZIP_STORED:
                checked = False  # compute_crc32 = False (torch.utils.serialization.config.save) writes 0; torch never compresses
                continue
            file.seek(record.header_offset)
            header = file.read(LOCAL_HEADER.size)
            if len(header) < LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                raise Corrupt(f"record {record.filename} has no valid header")
            *_, name_length, extra_length = LOCAL_HEADER.unpack(header)
            start = record.header_offset + LOCAL_HEADER.size + name_length + extra_length
            if (crc := crc32_of(file, start, record.compress_size, buffer)) != record.CRC:
                raise Corrupt(f"record {record.filename} fails its CRC-32 check (written {record.CRC:08x}, read {crc:08x})")
    return checked


def write_digests(directory: Path, digests: dict[str, dict]) -> None:
    """The manifest of a sharded checkpoint's files, written into its (unpublished) dir."""
    (directory / DIGESTS).write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")


def digests_of(paths: list[Path]) -> dict[str, dict]:
    """Each file's size and CRC-32, by file name: a rank's part of the manifest."""
    return {path.name: {"size": path.stat().st_size, "crc32": f"{file_crc32(path):08x}"} for path in paths}


def verify_sharded(directory: Path) -> bool:
    """Checks every file the dir's manifest lists, by size and CRC-32; True when it has a manifest,
    False when it has none (saved before manifests existed). A file that fails, or is missing, raises
    Corrupt, naming it."""
    manifest = directory / DIGESTS
    if not manifest.is_file():
        return False
    try:
        listed = json.loads(manifest.read_text())
        expected = {name: (int(entry["size"]), int(entry["crc32"], 16)) for name, entry in listed.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise Corrupt(f"{DIGESTS} is unreadable ({error})") from None
    for name, (size, crc) in expected.items():
        path = directory / name
        if not path.is_file():
            raise Corrupt(f"{name} is missing")
        if path.stat().st_size != size:
            raise Corrupt(f"{name} has {path.stat().st_size} bytes, {size} when saved")
        if (read := file_crc32(path)) != crc:
            raise Corrupt(f"{name} fails its CRC-32 check (written {crc:08x}, read {read:08x})")
    return True


def verify(path: Path) -> bool:
    """A checkpoint file or a sharded checkpoint's dir, verified: True, False where it carries no digest,
    Corrupt where its bytes changed after the save."""
    return verify_sharded(path) if path.is_dir() else verify_file(path)


def verdict_of(checker: subprocess.Popen, path: Path) -> bool | Corrupt:
    """The verdict of `checker` (this file run with VERDICT on `path`); where it gave none (no interpreter to start,
    killed), this process checks."""
    line = checker.communicate()[0].strip()
    if checker.returncode == 0 and line in ("good", "unverified"):
        return line == "good"
    if checker.returncode == 0 and line.startswith("corrupt "):
        return Corrupt(line.removeprefix("corrupt "))
    try:
        return verify(path)
    except Corrupt as error:
        return error


def checkpoints_of(run_dir: Path) -> list[Path]:
    """Every checkpoint of a run dir (`checkpoints/` in it): step files and dirs, last.pt, the kept best ones."""
    directory = run_dir / "checkpoints"
    return sorted(path for path in directory.iterdir() if not path.name.startswith(".") and (path.suffix == ".pt" or path.is_dir()))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == VERDICT:  # a checker beside a load (ddp/checkpoints/checkpoint.py): one line
        try:
            print("good" if verify(Path(argv[1])) else "unverified")
        except Corrupt as error:
            print(f"corrupt {error}")
        return 0
    if len(argv) != 1:
        print("usage: python -m ddp.checkpoints.verify <run dir, checkpoint file or sharded checkpoint dir>", file=sys.stderr)
        return 2
    target = Path(argv[0])
    paths = checkpoints_of(target) if (target / "checkpoints").is_dir() else [target]
    if not target.exists() or not paths:
        print(f"error: {target}: no checkpoint there (a run dir, a checkpoint file or a sharded checkpoint's dir)", file=sys.stderr)
        return 2
    corrupt = 0
    for path in paths:
        try:
            print(f"{'good' if verify(path) else 'unverified'}  {path}")
        except Corrupt as error:
            corrupt += 1
            print(f"corrupt  {path}: {error}: it changed after it was saved")
    return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

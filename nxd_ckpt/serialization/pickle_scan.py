"""Reading a pickle's structure without executing it: the global names a ``torch.save`` file would import.

Used to name the exact classes or functions an unsafe file holds (safe loading's error) and by ``verify`` to
check files no manifest covers. ``pickletools.genops`` walks opcodes; nothing is imported or called.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickletools
import zipfile
from typing import BinaryIO

from nxd_ckpt.errors import FormatError
from nxd_ckpt.serialization.torchzip import allowed_global_names


def allowed_globals() -> set[str]:
    """Names of the classes and functions safe loading accepts (``torchzip.allowed_global_names``)."""
    return allowed_global_names()


def scan_torch_file(f: BinaryIO, check_crc: bool = True) -> set[str]:
    """The global names a ``torch.save`` file's pickle would import, found without executing it.

    Zip archives (every torch.save since 1.6) also have their members' CRCs checked when ``check_crc`` (unless
    the writer disabled CRCs). Raises FormatError if the archive or its pickle is damaged.
    """
    head = f.read(4)
    f.seek(0)
    if head != b"PK\x03\x04":
        try:
            return _pickle_globals(f)
        except Exception as e:
            raise FormatError(f"not a readable torch.save file ({e})") from e
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
            pickles = [i for i in infos if i.filename.endswith("data.pkl")]
            if not pickles:
                raise FormatError("the archive has no data.pkl record")
            crc_enabled = any(i.CRC for i in infos if i.file_size)
            if check_crc and crc_enabled:
                bad = zf.testzip()
                if bad is not None:
                    raise FormatError(f"record {bad} fails its CRC check")
            with zf.open(pickles[0]) as p:
                if not crc_enabled:
                    p._expected_crc = None  # type: ignore[attr-defined] - the writer stored no CRCs
                return _pickle_globals(io.BytesIO(p.read()))
    except FormatError:
        raise
    except Exception as e:  # zipfile/pickletools raise many types on damaged input
        raise FormatError(f"{type(e).__name__}: {e}") from e


def _pickle_globals(f: BinaryIO) -> set[str]:
    names: set[str] = set()
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(f):
        if op.name == "GLOBAL":
            module, name = str(arg).split(" ", 1)
            names.add(_py3_name(module, name))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.add(_py3_name(strings[-2], strings[-1]))
        elif isinstance(arg, str) and "UNICODE" in op.name:
            strings.append(arg)
    return names


def _py3_name(module: str, name: str) -> str:
    """The name unpickling would import: protocol-2 pickles use Python 2 names (``__builtin__.exec``)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"

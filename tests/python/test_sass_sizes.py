"""tools/sass_sizes.py reads kernel sizes from a cubin's section headers: checked on a minimal
64-bit ELF built here (no CUDA needed), with a non-.text section it must skip."""

import importlib.util
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("sass_sizes", ROOT / "tools" / "sass_sizes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _elf(sections):
    """ELF64 with a null section, the given (name, size) sections and .shstrtab last."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    offsets, at = [], 1
    for n, _ in sections:
        offsets.append(at)
        at += len(n) + 1
    shstr_name = at
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    shoff = 64 + len(names)
    shnum = len(sections) + 2
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, shnum, shnum - 1)
    table = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    for off, (_, size) in zip(offsets, sections):
        table.append(struct.pack("<IIQQQQIIQQ", off, 1, 0, 0, 0, size, 0, 0, 0, 0))
    table.append(struct.pack("<IIQQQQIIQQ", shstr_name, 3, 0, 0, 64, len(names), 0, 0, 1, 0))
    return bytes(header) + names + b"".join(table)


def test_sass_sizes_lists_text_sections_by_size(tmp_path, capsys):
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(_elf([(".text.big_kernel", 4096), (".nv.info", 999), (".text.small_kernel", 256)]))
    tool = _tool()
    assert tool.text_sections(str(cubin)) == [(256, "small_kernel"), (4096, "big_kernel")]
    assert tool.main([str(cubin), "big"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].split() == ["4096", "big_kernel"]


def test_sass_sizes_refuses_what_is_not_an_elf(tmp_path):
    bad = tmp_path / "x.cubin"
    bad.write_bytes(b"not an elf at all" * 4)
    with pytest.raises(SystemExit, match="not a 64-bit ELF"):
        _tool().text_sections(str(bad))

"""The header of any safetensors file, read by hand: the files of other tools (a published model's shards, PEFT's
adapters), whose tensors nanoeuler then reads itself, a piece at a time, converting their dtypes on the way."""
import json
import struct

from nanoeuler.errors import UserError


def safetensors_header(path):
    """The file's JSON header ({name: {dtype, shape, data_offsets}}, `__metadata__` included) and the byte where
    its data begins (data_offsets count from there)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(n)), 8 + n
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"cannot read {path}: {e}") from None

"""worker/weights.py's checks of a file's bytes: NaN / Inf in a tensor, a folder cut short."""
import json

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pantheon.common.model_file import ModelFileError
from pantheon.common.formats import FORMATS
from pantheon.worker.weights import check_finite

SCALE_OFFSETS = {name: f.fp16_fields for name, f in FORMATS.items() if f.fp16_fields}


@pytest.mark.parametrize("kind", sorted(SCALE_OFFSETS))
def test_a_nan_or_inf_scale_of_any_quantized_block_is_named(kind):
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    blocks = np.zeros((10, size), dtype=np.uint8)          # every fp16 field 0.0: finite
    check_finite("w", blocks, kind)
    for off in SCALE_OFFSETS[kind]:
        for value in (np.nan, np.inf, -np.inf):
            bad = blocks.copy()
            bad[7, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
            with pytest.raises(ModelFileError, match=f"tensor w holds NaN or Inf .*block 7"):
                check_finite("w", bad, kind)


@pytest.mark.parametrize("kind, dtype", [("F32", np.float32), ("F16", np.float16)])
def test_a_nan_or_inf_float_is_named_with_its_element(kind, dtype):
    values = np.linspace(-1e4, 1e4, 3000).astype(dtype)
    check_finite("w", values.view(np.uint8), kind)
    values[2345] = np.inf
    with pytest.raises(ModelFileError, match="element 2345"):
        check_finite("w", values.view(np.uint8), kind)


def test_a_nan_bfloat16_is_named():
    bits = (np.ones(64, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    check_finite("w", bits.view(np.uint8), "BF16")
    bits[9] = 0x7FC0                                       # a bfloat16 NaN
    with pytest.raises(ModelFileError, match="element 9"):
        check_finite("w", bits.view(np.uint8), "BF16")


def test_a_safetensors_file_cut_short_names_the_tensor(tmp_path):
    from pantheon.common.weight_format import tensor_list
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header
                                                 + bytes(40))
    with pytest.raises(ModelFileError, match="truncated.*tensor b needs 32 bytes.*holds 24"):
        tensor_list(tmp_path)

"""Type-checked by mypy in the package stage (scripts/test_package.sh): what a user writes must
see real types, not Any. reveal_type lines are not used; the assignments below fail mypy if a
public annotation is missing or wrong."""

from typing import Optional, Tuple

import torch
from torch import Tensor

import torchmha

mha = torchmha.MultiheadAttention(8, 2, batch_first=True)
x = torch.randn(2, 4, 8)
result: Tuple[Tensor, Optional[Tensor]] = mha(x, x, x)
output: Tensor = mha.forward(x, x, x)[0]
cache: torchmha.KeyValueCache = torchmha.KeyValueCache.for_module(mha, batch_size=2, max_length=8)
step: Tensor = mha.forward_with_cache(x[:, :1], cache)
mixed: Tensor = mha.forward_with_cache(x[:, :2], cache, new_lengths=torch.tensor([1, 2]))
lengths: Tensor = cache.lengths
cache.reorder(torch.tensor([1, 0]))
cache.reset(torch.tensor([0]))
memory: torchmha.StaticKeyValue = mha.project_key_value(x)
v4: Tensor = torchmha.MultiheadAttentionV4(8, 2)(x, x, x)
block: Tensor = torchmha.TransformerBlock(8, 2)(x)
cross: Tensor = torchmha.CrossAttention(8, heads=2, dim_head=4)(x)
version: str = torchmha.__version__
info = torchmha.build_info()
built_for: Optional[object] = info["torch"]

# Each line below is a type error only if the annotation is real: mypy runs with
# --warn-unused-ignores, so an annotation lost to Any leaves an unused ignore and fails the check.
not_a_tensor: int = mha.forward(x, x, x)[0]  # type: ignore[assignment]
not_a_cache: int = torchmha.KeyValueCache.for_module(mha, batch_size=2, max_length=8)  # type: ignore[assignment]
not_an_output: int = mha.forward_with_cache(x[:, :1], cache)  # type: ignore[assignment]
not_lengths: int = cache.lengths  # type: ignore[assignment]
not_a_version: int = torchmha.__version__  # type: ignore[assignment]

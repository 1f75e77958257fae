#pragma once

// torchmha's public C++ API: the functional core, the article's v1-v4 modules, the full
// MultiheadAttention, decoding.h (key/value caches, CrossAttention, TransformerBlock) and
// cross-language checkpoints (serialization.h).
// Link TorchMHA::torchmha (find_package(TorchMHA)) or libtorchmha and include this header.

#include <torchmha/attention_versions.h>
#include <torchmha/decoding.h>
#include <torchmha/errors.h>
#include <torchmha/functional.h>
#include <torchmha/multihead_attention.h>
#include <torchmha/serialization.h>

#pragma once

// torchmha's public C++ API: the functional core (functional.h), the article's v1-v4 modules,
// the full MultiheadAttention with its decoding caches, CrossAttention, TransformerBlock, cached
// generation with LibTorch's Transformer stacks (cached_decoder.h), and cross-language checkpoints
// (serialization.h).
// Link TorchMHA::torchmha (find_package(TorchMHA)) or libtorchmha and include this header.

#include <torchmha/attention_versions.h>
#include <torchmha/cached_decoder.h>
#include <torchmha/cross_attention.h>
#include <torchmha/errors.h>
#include <torchmha/functional.h>
#include <torchmha/kv_cache.h>
#include <torchmha/multihead_attention.h>
#include <torchmha/serialization.h>
#include <torchmha/transformer_block.h>
#include <torchmha/version.h>

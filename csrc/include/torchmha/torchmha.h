#pragma once

// torchmha's public C++ API: the functional core, the article's v1-v4 modules and the full
// MultiheadAttention, and decoding.h (key/value caches, CrossAttention,
// TransformerBlock). Link TorchMHA::torchmha (or libtorchmha) and include this header.

#include <torchmha/attention_versions.h>
#include <torchmha/decoding.h>
#include <torchmha/errors.h>
#include <torchmha/functional.h>
#include <torchmha/multihead_attention.h>

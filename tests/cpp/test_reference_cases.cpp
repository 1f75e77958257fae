// Replays reference cases computed by Python's torch.nn.MultiheadAttention
// (tests/reference/make_cases.py, run by ctest as a fixture) through torchmha::MultiheadAttention:
// the C++ module against the Python semantics, on every option the cases cover.

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iterator>

namespace {

c10::IValue load_cases() {
  const char* path = std::getenv("TORCHMHA_REFERENCE_CASES");
  if (path == nullptr) {
    ADD_FAILURE() << "TORCHMHA_REFERENCE_CASES is not set; run through ctest, or set it to the output of "
                     "python tests/reference/make_cases.py OUT.pt";
    return {};
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    ADD_FAILURE() << "cannot open reference cases at " << path;
    return {};
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes);
}

torch::Tensor tensor_or_undefined(const c10::IValue& value) {
  return value.isNone() ? torch::Tensor() : value.toTensor();
}

TEST(ReferenceCases, CppModuleReproducesPythonTorch) {
  const c10::IValue cases = load_cases();
  ASSERT_TRUE(cases.isList());
  const auto list = cases.toList();
  ASSERT_GE(list.size(), 50u);
  for (size_t i = 0; i < list.size(); ++i) {
    const auto c = list.get(i).toGenericDict();
    auto get = [&](const char* key) { return c.at(key); };
    torchmha::MultiheadAttention mha(torchmha::MultiheadAttentionOptions(get("embed_dim").toInt(), get("num_heads").toInt())
                                         .bias(get("bias").toBool())
                                         .add_bias_kv(get("add_bias_kv").toBool())
                                         .add_zero_attn(get("add_zero_attn").toBool())
                                         .kdim(get("kdim").toInt())
                                         .vdim(get("vdim").toInt())
                                         .batch_first(get("batch_first").toBool()));
    mha->to(torch::kFloat64);
    mha->eval();
    auto ours = mha->named_parameters();
    {
      torch::NoGradGuard no_grad;
      for (const auto& entry : get("parameters").toGenericDict()) {
        const auto name = entry.key().toStringRef();
        ASSERT_TRUE(ours.contains(name)) << "case " << i << ": no parameter " << name;
        ours[name].copy_(entry.value().toTensor());
      }
      ASSERT_EQ(ours.size(), get("parameters").toGenericDict().size()) << "case " << i;
    }
    torch::NoGradGuard no_grad;
    auto [output, weights] = mha->forward(
        get("query").toTensor(), get("key").toTensor(), get("value").toTensor(),
        tensor_or_undefined(get("key_padding_mask")), get("need_weights").toBool(),
        tensor_or_undefined(get("attn_mask")), get("average_attn_weights").toBool());
    SCOPED_TRACE("reference case " + std::to_string(i));
    torchmha_test::expect_close(output, get("output").toTensor());
    const auto expected_weights = tensor_or_undefined(get("weights"));
    ASSERT_EQ(weights.defined(), expected_weights.defined());
    if (weights.defined()) {
      torchmha_test::expect_close(weights, expected_weights);
    }
  }
}

}  // namespace

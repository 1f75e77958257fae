// CachedDecoder (cached_decoder.h) over LibTorch's own TransformerDecoder and TransformerEncoder:
// every cached step against the module's forward over the whole prefix with a causal mask.

#include <torchmha/torchmha.h>

#include "test_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

using torch::Tensor;
using torchmha_test::expect_close;
using torchmha_test::f64;

constexpr int64_t kDModel = 16, kHeads = 4, kFeedForward = 24, kLayers = 2, kMemoryLength = 5, kPrompt = 3;

// Every parameter random, the norms' weights around 1, so a dropped, swapped or zero-assumed
// parameter shows.
void randomize(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.named_parameters()) {
    p.value().normal_(0, 0.3);
    const std::string& name = p.key();
    const bool norm_weight = name.find("norm") != std::string::npos && name.size() > 6 &&
                             name.compare(name.size() - 6, 6, "weight") == 0;
    if (norm_weight) {
      p.value().add_(1);
    }
  }
}

// 2 layers, gelu, a final LayerNorm; norm2's eps changed after construction, which the step must read.
torch::nn::TransformerDecoder make_decoder() {
  torch::nn::TransformerDecoderLayer layer(
      torch::nn::TransformerDecoderLayerOptions(kDModel, kHeads).dim_feedforward(kFeedForward).activation(torch::kGELU));
  torch::nn::TransformerDecoder model(torch::nn::TransformerDecoderOptions(layer, kLayers)
                                          .norm(torch::nn::AnyModule(torch::nn::LayerNorm(
                                              torch::nn::LayerNormOptions({kDModel}).eps(1e-3)))));
  for (const auto& module : *model->layers) {
    module->as<torch::nn::TransformerDecoderLayer>()->norm2->options.eps(1e-2);
  }
  model->to(torch::kFloat64);
  randomize(*model);
  model->eval();
  return model;
}

// 2 layers, relu, no final norm.
torch::nn::TransformerEncoder make_encoder() {
  torch::nn::TransformerEncoderLayer layer(
      torch::nn::TransformerEncoderLayerOptions(kDModel, kHeads).dim_feedforward(kFeedForward).activation(torch::kReLU));
  torch::nn::TransformerEncoder model(torch::nn::TransformerEncoderOptions(layer, kLayers));
  model->to(torch::kFloat64);
  randomize(*model);
  model->eval();
  return model;
}

Tensor causal_mask(int64_t length) {
  return torch::full({length, length}, -std::numeric_limits<double>::infinity(), f64()).triu(1);
}

// The module's own forward over whole sequences (T, N, E), causally.
Tensor decoder_forward(torch::nn::TransformerDecoder& model, const Tensor& tgt, const Tensor& memory,
                       const Tensor& memory_key_padding_mask = {}) {
  return model->forward(tgt, memory, causal_mask(tgt.size(0)), {}, {}, memory_key_padding_mask);
}

Tensor encoder_forward(torch::nn::TransformerEncoder& model, const Tensor& src) {
  return model->forward(src, causal_mask(src.size(0)));
}

// A prompt of kPrompt positions, then one position a step; each output against `reference` over
// the prefix so far, at the new rows.
void expect_steps_match(const torchmha::CachedDecoder& dec, torchmha::DecoderState& state, const Tensor& x,
                        const std::function<Tensor(const Tensor&)>& reference) {
  expect_close(dec(x.narrow(0, 0, kPrompt), state), reference(x.narrow(0, 0, kPrompt)));
  for (int64_t t = kPrompt; t < x.size(0); ++t) {
    expect_close(dec(x.narrow(0, t, 1), state), reference(x.narrow(0, 0, t + 1)).narrow(0, t, 1));
  }
  EXPECT_TRUE(torch::equal(state.lengths(), torch::full({x.size(1)}, x.size(0), torch::kLong)));
}

template <typename Fn>
void expect_error(Fn&& fn, const std::string& part) {
  try {
    fn();
    FAIL() << "expected an error mentioning " << part;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(CachedDecoder, DecoderStepsEqualTheModulesForward) {
  torch::manual_seed(0);
  auto model = make_decoder();
  torchmha::CachedDecoder dec(model);
  EXPECT_TRUE(dec.is_decoder());
  EXPECT_EQ(dec.num_layers(), kLayers);
  EXPECT_EQ(dec.num_heads(), kHeads);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({kPrompt + 3, 2, kDModel}, f64());
  const auto memory = torch::randn({kMemoryLength, 2, kDModel}, f64());
  auto padding = torch::zeros({2, kMemoryLength}, torch::kBool);
  padding[1].narrow(0, kMemoryLength - 2, 2).fill_(true);  // sequence 1's memory is 3 positions long
  auto state = dec.new_state(2, 8, memory, padding);
  EXPECT_EQ(state.keys().sizes(), torch::IntArrayRef({kLayers, 2, kHeads, 8, kDModel / kHeads}));
  EXPECT_EQ(state.keys().scalar_type(), torch::kFloat64);
  expect_steps_match(dec, state, x, [&](const Tensor& prefix) { return decoder_forward(model, prefix, memory, padding); });
}

TEST(CachedDecoder, EncoderStepsEqualTheModulesCausalForward) {
  torch::manual_seed(1);
  auto model = make_encoder();
  torchmha::CachedDecoder dec(model);
  EXPECT_FALSE(dec.is_decoder());
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({kPrompt + 3, 2, kDModel}, f64());
  auto state = dec.new_state(2, 8);
  EXPECT_FALSE(state.memory_keys().defined());
  expect_steps_match(dec, state, x, [&](const Tensor& prefix) { return encoder_forward(model, prefix); });
}

TEST(CachedDecoder, ReadsTheParametersOnEveryStep) {
  torch::manual_seed(2);
  auto model = make_encoder();
  torchmha::CachedDecoder dec(model);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    p.mul_(1.25);  // after the CachedDecoder was made
  }
  const auto x = torch::randn({kPrompt, 2, kDModel}, f64());
  auto state = dec.new_state(2, 4);
  expect_close(dec(x, state), encoder_forward(model, x));
}

TEST(CachedDecoder, ReorderThenContinueEqualsTheReorderedHistories) {
  torch::manual_seed(3);
  auto model = make_decoder();
  torchmha::CachedDecoder dec(model);
  torch::NoGradGuard no_grad;
  const auto prompt = torch::randn({kPrompt, 3, kDModel}, f64());
  const auto memory = torch::randn({kMemoryLength, 3, kDModel}, f64());
  auto state = dec.new_state(3, 8, memory);
  dec(prompt, state);
  const auto beams = torch::tensor({2, 0, 0}, torch::kLong);
  state.reorder(beams);
  const auto next = torch::randn({1, 3, kDModel}, f64());
  const auto history = torch::cat({prompt.index_select(1, beams), next});
  expect_close(dec(next, state), decoder_forward(model, history, memory.index_select(1, beams)).narrow(0, kPrompt, 1));
}

TEST(CachedDecoder, ResetOneSlotWithANewShorterMemory) {
  torch::manual_seed(4);
  auto model = make_decoder();
  torchmha::CachedDecoder dec(model);
  torch::NoGradGuard no_grad;
  const auto prompt = torch::randn({kPrompt, 2, kDModel}, f64());
  const auto memory = torch::randn({kMemoryLength, 2, kDModel}, f64());
  auto state = dec.new_state(2, 8, memory);
  dec(prompt, state);
  // Slot 1 starts a new sequence with a memory of 4 positions (the state holds 5; the 5th is masked).
  const auto new_memory = torch::randn({kMemoryLength - 1, 1, kDModel}, f64());
  state.reset(torch::tensor({1}, torch::kLong), new_memory);
  EXPECT_TRUE(torch::equal(state.lengths(), torch::tensor({kPrompt, int64_t{0}}, torch::kLong)));
  const auto next = torch::randn({2, 2, kDModel}, f64());
  const auto y = torch::cat({dec(next.narrow(0, 0, 1), state), dec(next.narrow(0, 1, 1), state)});
  const auto slot0 = torch::cat({prompt.narrow(1, 0, 1), next.narrow(1, 0, 1)});
  expect_close(y.narrow(1, 0, 1), decoder_forward(model, slot0, memory.narrow(1, 0, 1)).narrow(0, kPrompt, 2));
  expect_close(y.narrow(1, 1, 1), decoder_forward(model, next.narrow(1, 1, 1), new_memory));
}

TEST(CachedDecoder, MemoryOnlyForADecoder) {
  auto encoder = make_encoder();
  torchmha::CachedDecoder dec(encoder);
  const auto memory = torch::randn({kMemoryLength, 2, kDModel}, f64());
  EXPECT_THROW(dec.new_state(2, 8, memory), c10::ValueError);
  auto state = dec.new_state(2, 8);
  EXPECT_THROW(state.reset({}, memory.narrow(1, 0, 1)), c10::ValueError);
  auto decoder = make_decoder();
  EXPECT_THROW(torchmha::CachedDecoder(decoder).new_state(2, 8), c10::ValueError);
}

TEST(CachedDecoder, TrainingModeIsRefusedAndTheStateKept) {
  auto model = make_encoder();
  torchmha::CachedDecoder dec(model);
  auto state = dec.new_state(2, 8);
  model->train();
  expect_error([&] { dec(torch::randn({1, 2, kDModel}, f64()), state); }, "eval()");
  EXPECT_EQ(state.lengths().sum().item<int64_t>(), 0);
}

TEST(CachedDecoder, UnsupportedActivationOrFinalNormIsATypeError) {
  torch::nn::TransformerDecoderLayer layer(torch::nn::TransformerDecoderLayerOptions(kDModel, kHeads)
                                               .activation(std::function<Tensor(const Tensor&)>([](const Tensor& t) { return t.tanh(); })));
  torch::nn::TransformerDecoder with_function(torch::nn::TransformerDecoderOptions(layer, 1));
  EXPECT_THROW(torchmha::CachedDecoder{with_function}, c10::TypeError);
  expect_error([&] { torchmha::CachedDecoder{with_function}; }, "torch::kReLU, torch::kGELU");
  torch::nn::TransformerEncoder with_identity(
      torch::nn::TransformerEncoderOptions(torch::nn::TransformerEncoderLayer(kDModel, kHeads), 1)
          .norm(torch::nn::AnyModule(torch::nn::Identity())));
  EXPECT_THROW(torchmha::CachedDecoder{with_identity}, c10::TypeError);
}

// ------------------------------------------------------------------------------ int8 weights

bool is_linear_weight(const std::string& name) {
  for (const std::string end : {"in_proj_weight", "out_proj.weight", "linear1.weight", "linear2.weight"}) {
    if (name.size() >= end.size() && name.compare(name.size() - end.size(), end.size(), end) == 0) {
      return true;
    }
  }
  return false;
}

// The model with its linear weights replaced by the int8 weights CachedDecoder reads, dequantized:
// the float model an int8 step must equal.
template <typename Model>
Model dequantized(const Model& model) {
  auto copy = std::dynamic_pointer_cast<typename Model::Impl>(model->clone());
  torch::NoGradGuard no_grad;
  for (auto& p : copy->named_parameters()) {
    if (is_linear_weight(p.key())) {
      const auto [q, scale] = torchmha::quantize_weight(p.value());
      p.value().copy_(q.to(torch::kFloat64) * scale.to(torch::kFloat64).unsqueeze(1));
    }
  }
  return Model(copy);
}

TEST(CachedDecoder, Int8StepsEqualTheDequantizedModel) {
  torch::manual_seed(3);
  auto model = make_decoder();
  torchmha::CachedDecoder dec(model, torch::kChar);
  EXPECT_EQ(dec.weight_dtype(), torch::kChar);
  auto reference = dequantized(model);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({kPrompt + 3, 2, kDModel}, f64());
  const auto memory = torch::randn({kMemoryLength, 2, kDModel}, f64());
  auto state = dec.new_state(2, 8, memory);
  expect_steps_match(dec, state, x, [&](const Tensor& prefix) { return decoder_forward(reference, prefix, memory); });
  // and the quantization shows: the model's own float weights give another answer
  EXPECT_GT((dec(x.narrow(0, 0, 1), state = dec.new_state(2, 8, memory)) -
             decoder_forward(model, x.narrow(0, 0, 1), memory)).abs().max().item<double>(), 1e-5);
}

// One position a sequence in float32 takes the kernel step (csrc/core/stack_kernel_step.cpp); the
// same step with new_lengths runs the composition: the same outputs and caches, bit for bit.
TEST(CachedDecoder, OnePositionStepsEqualTheCompositionBitForBit) {
  for (const auto weight_dtype : {std::optional<at::ScalarType>(), std::optional<at::ScalarType>(torch::kChar)}) {
    torch::manual_seed(5);
    auto model = make_decoder();
    model->to(torch::kFloat32);
    torchmha::CachedDecoder dec(model, weight_dtype);
    c10::InferenceMode inference;
    const auto memory = torch::randn({kMemoryLength, 3, kDModel});
    auto kernel = dec.new_state(3, 8, memory), composed = dec.new_state(3, 8, memory);
    for (const int64_t T : {2, 1, 1, 1}) {
      const auto x = torch::randn({T, 3, kDModel});
      EXPECT_TRUE(torch::equal(dec(x, kernel), dec(x, composed, torch::full({3}, T, torch::kLong)))) << T;
    }
    EXPECT_TRUE(torch::equal(kernel.keys(), composed.keys()) && torch::equal(kernel.values(), composed.values()));
    EXPECT_TRUE(torch::equal(kernel.lengths(), composed.lengths()));
  }
}

TEST(CachedDecoder, Int8WeightsFollowAChangedModel) {
  torch::manual_seed(4);
  auto model = make_encoder();
  torchmha::CachedDecoder dec(model, torch::kChar);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    p.mul_(1.25);  // in place, after the CachedDecoder was made: seen by the version counters
  }
  const auto x = torch::randn({kPrompt, 2, kDModel}, f64());
  auto state = dec.new_state(2, 4);
  auto reference = dequantized(model);
  expect_close(dec(x, state), encoder_forward(reference, x));
  model->layers[0]->as<torch::nn::TransformerEncoderLayer>()->linear1->weight.data().mul_(-1);  // unseen
  dec.refresh();
  state = dec.new_state(2, 4);
  reference = dequantized(model);
  expect_close(dec(x, state), encoder_forward(reference, x));
}

// The warnings c10 raises while it is installed (c10::WarningUtils::WarningHandlerGuard).
struct WarningCapture : c10::WarningHandler {
  std::vector<std::string> messages;
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
};

TEST(CachedDecoder, Int8FromAModelMadeUnderInferenceMode) {
  torch::manual_seed(5);
  const c10::InferenceMode inference;
  auto model = make_encoder();  // inference tensors: no version counter (reading one throws)
  WarningCapture capture;
  std::optional<torchmha::CachedDecoder> dec;
  {
    const c10::WarningUtils::WarningHandlerGuard guard(&capture);
    dec.emplace(model, torch::kChar);
  }
  ASSERT_EQ(capture.messages.size(), 1u);
  EXPECT_NE(capture.messages[0].find("inference tensors"), std::string::npos) << capture.messages[0];
  EXPECT_NE(capture.messages[0].find("call refresh()"), std::string::npos) << capture.messages[0];
  const auto x = torch::randn({kPrompt, 2, kDModel}, f64());
  auto state = dec->new_state(2, 4);
  auto reference = dequantized(model);
  expect_close((*dec)(x, state), encoder_forward(reference, x));
}

TEST(CachedDecoder, OnlyInt8IsAWeightDtype) {
  auto model = make_encoder();
  expect_error([&] { torchmha::CachedDecoder(model, torch::kHalf); }, "weight_dtype must be at::kChar");
}

}  // namespace

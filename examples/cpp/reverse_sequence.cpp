// Trains a one-layer attention model in C++ to reverse token sequences, then checks that both
// checkpoint formats restore it exactly; then generates greedily through a LibTorch
// TransformerDecoder with torchmha::CachedDecoder and checks it against recomputing every prefix.
//
//   reverse_sequence [output_dir]     (default: the current directory)
//
// Writes to output_dir:
//   reverse_model.pt       torch::save(model): LibTorch's own archive (torch::load reads it back)
//   reverse_state_dict.pt  torchmha::save_state_dict(model): torch.save's format, for Python
//   reverse_sample.pt      {"tokens", "logits"}: an input batch and the trained model's output on
//                          it, so a Python model loaded from reverse_state_dict.pt can be checked
// Exits non-zero if the loss did not drop clearly, a reloaded model computes other outputs, or
// cached generation differs from the recomputed one.

#include <torchmha/torchmha.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kVocabulary = 10;
constexpr int64_t kLength = 8;
constexpr int64_t kEmbedDim = 32;
constexpr int64_t kHeads = 2;
constexpr int64_t kBatch = 64;
constexpr int kSteps = 300;

// Token and position embeddings, one torchmha self-attention layer, a linear head. Reversing
// needs only attention: position i attends to position length-1-i and copies its token. The
// parameter names are those of the Python model in tests/python/test_serialization.py.
struct ReverserImpl : torch::nn::Module {
  ReverserImpl()
      : token_embedding(register_module("token_embedding", torch::nn::Embedding(kVocabulary, kEmbedDim))),
        position_embedding(register_module("position_embedding", torch::nn::Embedding(kLength, kEmbedDim))),
        attention(register_module(
            "attention",
            torchmha::MultiheadAttention(torchmha::MultiheadAttentionOptions(kEmbedDim, kHeads).batch_first(true)))),
        head(register_module("head", torch::nn::Linear(kEmbedDim, kVocabulary))) {}

  /// tokens [N, L] (int64) -> logits [N, L, vocabulary].
  torch::Tensor forward(const torch::Tensor& tokens) {
    const auto positions = torch::arange(tokens.size(1), tokens.options());
    const auto x = token_embedding(tokens) + position_embedding(positions);
    const auto attended = std::get<0>(attention->forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/false));
    return head(attended);
  }

  torch::nn::Embedding token_embedding, position_embedding;
  torchmha::MultiheadAttention attention;
  torch::nn::Linear head;
};
TORCH_MODULE(Reverser);

torch::Tensor random_tokens(int64_t batch) {
  return torch::randint(kVocabulary, {batch, kLength}, torch::kInt64);
}

torch::Tensor loss_on(Reverser& model, const torch::Tensor& tokens) {
  const auto logits = model(tokens);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocabulary}), tokens.flip(1).reshape(-1));
}

bool check(bool ok, const std::string& what) {
  std::cout << (ok ? "ok:     " : "FAILED: ") << what << "\n";
  return ok;
}

// ------------------------------------------------------------------- cached generation

constexpr int64_t kGenModel = 64;
constexpr int64_t kGenHeads = 4;
constexpr int64_t kGenBatch = 4;
constexpr int64_t kGenSteps = 32;
constexpr int64_t kMemoryLength = 16;

// Token and position embeddings into LibTorch's own TransformerDecoder, then a linear head.
// Untrained: what matters here is that cached and recomputed generation agree.
struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl()
      : tokens(register_module("tokens", torch::nn::Embedding(kVocabulary, kGenModel))),
        positions(register_module("positions", torch::nn::Embedding(kGenSteps, kGenModel))),
        decoder(register_module("decoder", torch::nn::TransformerDecoder(torch::nn::TransformerDecoderOptions(
                                               torch::nn::TransformerDecoderLayer(
                                                   torch::nn::TransformerDecoderLayerOptions(kGenModel, kGenHeads)
                                                       .dim_feedforward(4 * kGenModel)),
                                               /*num_layers=*/2)))),
        head(register_module("head", torch::nn::Linear(kGenModel, kVocabulary))) {}

  /// token_ids (T, N) at positions first, first+1, ... -> the decoder's input (T, N, E).
  torch::Tensor embed(const torch::Tensor& token_ids, int64_t first) {
    const auto where = torch::arange(first, first + token_ids.size(0), token_ids.options());
    return tokens(token_ids) + positions(where).unsqueeze(1);
  }

  torch::nn::Embedding tokens, positions;
  torch::nn::TransformerDecoder decoder;
  torch::nn::Linear head;
};
TORCH_MODULE(Generator);

struct Generation {
  torch::Tensor tokens;   // (kGenSteps + 1, N): the start token, then one per step
  torch::Tensor outputs;  // (kGenSteps, N, E): the decoder's output at each step's last position
  double ms_per_token = 0;
};

// Greedy decoding: step(the tokens so far (t + 1, N)) returns the decoder's output at the last one.
template <typename Step>
Generation generate(Generator& generator, Step&& step) {
  std::vector<torch::Tensor> tokens{torch::zeros({kGenBatch}, torch::kInt64)}, outputs;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < kGenSteps; ++t) {
    outputs.push_back(step(torch::stack(tokens)));
    tokens.push_back(generator->head(outputs.back()).argmax(-1));
  }
  const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
  return {torch::stack(tokens), torch::stack(outputs), elapsed.count() / kGenSteps};
}

// One new position a step through the key/value cache: each token's work is one position's.
Generation generate_cached(Generator& generator, const torch::Tensor& memory) {
  torchmha::CachedDecoder cached(generator->decoder);
  auto state = cached.new_state(kGenBatch, kGenSteps, memory);
  return generate(generator, [&](const torch::Tensor& tokens) {
    const int64_t t = tokens.size(0) - 1;
    return cached(generator->embed(tokens.narrow(0, t, 1), t), state)[0];
  });
}

// The whole prefix again every step, with a causal mask: the module's own forward.
Generation generate_recomputed(Generator& generator, const torch::Tensor& memory) {
  return generate(generator, [&](const torch::Tensor& tokens) {
    const int64_t length = tokens.size(0);
    const auto mask = torch::nn::TransformerImpl::generate_square_subsequent_mask(length);
    return generator->decoder->forward(generator->embed(tokens, 0), memory, mask)[length - 1];
  });
}

bool check_cached_generation() {
  Generator generator;
  generator->eval();  // no dropout: CachedDecoder refuses a model in training mode
  const auto memory = torch::randn({kMemoryLength, kGenBatch, kGenModel});
  const Generation cached = generate_cached(generator, memory);
  const Generation recomputed = generate_recomputed(generator, memory);
  const double difference = (cached.outputs - recomputed.outputs).abs().max().item<double>();
  std::cout << "greedy generation of " << kGenSteps << " tokens x " << kGenBatch << ": cached "
            << cached.ms_per_token << " ms/token, recomputed " << recomputed.ms_per_token
            << " ms/token; largest output difference " << difference << "\n";
  bool ok = check(torch::equal(cached.tokens, recomputed.tokens), "CachedDecoder: the same tokens as recomputing");
  ok &= check(difference < 1e-4, "CachedDecoder: the same decoder outputs as recomputing (float32)");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string output_dir = argc > 1 ? argv[1] : ".";
  torch::manual_seed(0);

  Reverser model;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  const auto held_out = random_tokens(256);
  const double initial_loss = loss_on(model, held_out).item<double>();

  for (int step = 1; step <= kSteps; ++step) {
    optimizer.zero_grad();
    auto loss = loss_on(model, random_tokens(kBatch));
    loss.backward();
    optimizer.step();
    if (step % 100 == 0) {
      std::cout << "step " << step << "  training loss " << loss.item<double>() << "\n";
    }
  }

  model->eval();
  torch::NoGradGuard no_grad;
  const double final_loss = loss_on(model, held_out).item<double>();
  const auto logits = model(held_out);
  const double accuracy = (logits.argmax(-1) == held_out.flip(1)).to(torch::kFloat64).mean().item<double>();
  std::cout << "held-out loss " << initial_loss << " -> " << final_loss << ", token accuracy " << accuracy << "\n";

  bool ok = check(final_loss < 0.25 * initial_loss, "loss fell below a quarter of its initial value");

  // LibTorch's archive, into a freshly initialised model.
  const std::string archive_path = output_dir + "/reverse_model.pt";
  torch::save(model, archive_path);
  Reverser from_archive;
  torch::load(from_archive, archive_path);
  from_archive->eval();
  ok &= check(torch::equal(from_archive(held_out), logits), "torch::save / torch::load: identical outputs");

  // The cross-language state dict, into another fresh model.
  const std::string state_dict_path = output_dir + "/reverse_state_dict.pt";
  torchmha::save_state_dict(*model, state_dict_path);
  Reverser from_state_dict;
  torchmha::load_state_dict(*from_state_dict, state_dict_path);
  from_state_dict->eval();
  ok &= check(torch::equal(from_state_dict(held_out), logits), "torchmha::save_state_dict / load_state_dict: identical outputs");

  torchmha::StateDict sample;
  sample.insert("tokens", held_out);
  sample.insert("logits", logits);
  torchmha::save_state_dict(sample, output_dir + "/reverse_sample.pt");

  ok &= check_cached_generation();

  std::cout << (ok ? "all checks passed" : "some checks FAILED") << "\n";
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}

// Checkpoints: save_state_dict / load_state_dict round trips in C++, and their errors. The Python
// side of the format (torch.load / torch.save) is tested in tests/python/test_checkpoints_cpp.py.

#include <torchmha/torchmha.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

namespace {

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "torchmha_" + name + ".pt";
}

TEST(Serialization, RoundTripRestoresEveryParameterAndTheOutput) {
  torch::manual_seed(0);
  torchmha::MultiheadAttention saved(torchmha::MultiheadAttentionOptions(16, 4).add_bias_kv(true).kdim(8));
  torchmha::MultiheadAttention restored(torchmha::MultiheadAttentionOptions(16, 4).add_bias_kv(true).kdim(8));
  const std::string path = temp_path("round_trip");
  torchmha::save_state_dict(*saved, path);
  torchmha::load_state_dict(*restored, path);
  std::remove(path.c_str());

  for (const auto& item : saved->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), restored->named_parameters()[item.key()])) << item.key();
  }
  auto q = torch::randn({5, 2, 16}), k = torch::randn({7, 2, 8}), v = torch::randn({7, 2, 16});
  EXPECT_TRUE(torch::equal(std::get<0>(saved(q, k, v)), std::get<0>(restored(q, k, v))));
}

TEST(Serialization, StateDictNamesAreTorchsPythonNames) {
  torchmha::MultiheadAttention mha(8, 2);
  std::vector<std::string> names;
  for (const auto& item : torchmha::state_dict(*mha)) {
    names.push_back(item.key());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}));
}

TEST(Serialization, MismatchedCheckpointIsRejectedWithoutChangingTheModule) {
  torchmha::MultiheadAttention small(8, 2), large(16, 2);
  const auto before = large->in_proj_weight.clone();
  const std::string path = temp_path("mismatch");
  torchmha::save_state_dict(*small, path);
  try {
    torchmha::load_state_dict(*large, path);
    ADD_FAILURE() << "no error for a checkpoint of another shape";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("in_proj_weight"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
  EXPECT_TRUE(torch::equal(large->in_proj_weight, before));
}

TEST(Serialization, MissingFileIsAnError) {
  torchmha::MultiheadAttention mha(8, 2);
  EXPECT_THROW(torchmha::load_state_dict(*mha, temp_path("does_not_exist")), c10::Error);
}

}  // namespace

// deploy.h in a program that links torchmha: load_scripted_module loads TorchScript that calls
// torchmha's operators and leaves torch's other errors alone. The program that does not link
// torchmha, and a module saved by a newer torchmha, are tested end to end by
// tests/python/test_deploy.py with the examples/deploy binaries.

#include <torchmha/deploy.h>
#include <torchmha/functional.h>

#include <gtest/gtest.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/script.h>

#include <cstdio>
#include <string>

namespace {

// TorchScript source defined in C++ sees `torch` as aten only; this resolver also makes
// `torchmha.<op>` name torchmha's operators, as a module scripted in Python calls them.
struct TorchmhaResolver : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& function,
                                                         const torch::jit::SourceRange& location) override {
    if (name == "torchmha") {
      return std::make_shared<torch::jit::BuiltinModule>("torchmha");
    }
    return torch::jit::nativeResolver()->resolveValue(name, function, location);
  }
};

TEST(Deploy, OperatorsAreLoadedInAProgramThatLinksTorchmha) {
  EXPECT_TRUE(torchmha::operators_loaded());
}

TEST(Deploy, LoadsAScriptedModuleThatCallsTorchmhaOperators) {
  torch::manual_seed(0);
  torch::jit::Module module("Projector");
  const auto weight = torch::randn({24, 8});
  module.register_parameter("weight", weight, /*is_buffer=*/false);
  module.define(R"(
def forward(self, x):
    return torchmha.in_projection_packed(x, x, x, self.weight)[0]
)",
                std::make_shared<TorchmhaResolver>());
  const std::string path = ::testing::TempDir() + "torchmha_deploy_projector.pt";
  module.save(path);

  auto loaded = torchmha::load_scripted_module(path);
  std::remove(path.c_str());
  const auto x = torch::randn({3, 2, 8});
  EXPECT_TRUE(torch::equal(loaded.forward({x}).toTensor(), torchmha::in_projection_packed(x, x, x, weight)[0]));
}

TEST(Deploy, OtherLoadErrorsAreTorchsOwn) {
  const std::string path = ::testing::TempDir() + "torchmha_deploy_no_such_file.pt";
  try {
    torchmha::load_scripted_module(path);
    FAIL() << "loaded a file that does not exist";
  } catch (const torchmha::OperatorsNotLoaded& error) {
    FAIL() << "translated an unrelated error: " << error.what();
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find(path), std::string::npos) << error.what();
  }
}

TEST(Deploy, FindsTheMissingOperatorInTorchsMessage) {
  using torchmha::detail::missing_torchmha_operator;
  EXPECT_EQ(missing_torchmha_operator("\nUnknown builtin op: torchmha::multi_head_attention_forward.\nCould not find"),
            "torchmha::multi_head_attention_forward");
  EXPECT_EQ(missing_torchmha_operator("Unknown builtin op: torchmha::cross_attention"), "torchmha::cross_attention");
  EXPECT_EQ(missing_torchmha_operator("\nUnknown builtin op: other::op.\n"), std::nullopt);
  EXPECT_EQ(missing_torchmha_operator("open file failed"), std::nullopt);
}

}  // namespace

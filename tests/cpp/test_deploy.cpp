// deploy.h in a program that links torchmha: load_scripted_module loads TorchScript that calls
// torchmha's operators, says when the loaded torchmha lacks one (a module saved by another
// version) and leaves torch's other errors alone. The program that does not link torchmha is
// tested end to end by tests/python/test_deploy.py with the examples/deploy binaries (which also
// load a module saved by a "newer" torchmha).

#include <torchmha/deploy.h>
#include <torchmha/functional.h>

#include <gtest/gtest.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/library.h>
#include <torch/script.h>

#include <cstdio>
#include <optional>
#include <string>

namespace {

// TorchScript source defined in C++ sees `torch` as aten only; this resolver also makes
// `<op_namespace>.<op>` name that namespace's operators (torchmha's by default), as a module
// scripted in Python calls them.
struct TorchmhaResolver : torch::jit::Resolver {
  explicit TorchmhaResolver(std::string op_namespace = "torchmha") : op_namespace(std::move(op_namespace)) {}

  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& function,
                                                         const torch::jit::SourceRange& location) override {
    if (name == op_namespace) {
      return std::make_shared<torch::jit::BuiltinModule>(op_namespace);
    }
    return torch::jit::nativeResolver()->resolveValue(name, function, location);
  }

  std::string op_namespace;
};

// Saves (under `file_name` in the test's temporary directory) a module whose forward calls
// <op_namespace>::deploy_probe, an operator registered only while the module is scripted and
// saved: loading the file then fails as for a module saved by a library version that has an
// operator this process lacks.
std::string save_module_calling_a_gone_operator(const std::string& op_namespace, const std::string& file_name) {
  const std::string path = ::testing::TempDir() + file_name;
  torch::Library library(torch::Library::FRAGMENT, op_namespace, std::nullopt, __FILE__, __LINE__);
  library.def("deploy_probe(Tensor x) -> Tensor");
  {
    torch::jit::Module module("Probe");
    module.define("def forward(self, x):\n    return " + op_namespace + ".deploy_probe(x)\n",
                  std::make_shared<TorchmhaResolver>(op_namespace));
    module.save(path);
  }
  return path;  // `library` ends the registration
}

struct LoadFailure {
  bool operators_not_loaded;
  std::string message;
};

// What load_scripted_module(path) threw; the file is removed.
LoadFailure load_failure(const std::string& path) {
  LoadFailure failure{false, "(no exception: the module loaded)"};
  try {
    torchmha::load_scripted_module(path);
  } catch (const torchmha::OperatorsNotLoaded& error) {
    failure = {true, error.what()};
  } catch (const std::exception& error) {
    failure = {false, error.what()};
  }
  std::remove(path.c_str());
  return failure;
}

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

TEST(Deploy, SaysWhenTheLoadedTorchmhaLacksAnOperator) {
  // As a module saved by a newer torchmha: libtorchmha is loaded, but the operator is not its.
  const auto path = save_module_calling_a_gone_operator("torchmha", "torchmha_deploy_newer.pt");
  const auto failure = load_failure(path);
  ASSERT_TRUE(failure.operators_not_loaded) << failure.message;
  const auto& message = failure.message;
  EXPECT_NE(message.find("cannot load the TorchScript module '" + path +
                         "': it calls torchmha::deploy_probe, which the loaded libtorchmha does not have"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("saved with another version of torchmha"), std::string::npos) << message;
  EXPECT_EQ(message.find("target_link_libraries"), std::string::npos) << message;
  EXPECT_NE(message.find("\ntorch::jit::load said: Unknown builtin op: torchmha::deploy_probe"), std::string::npos)
      << message;
}

TEST(Deploy, UnknownOperatorsOfOtherNamespacesAreTorchsOwnError) {
  // A namespace that merely starts with "torchmha" is not torchmha's.
  const auto path = save_module_calling_a_gone_operator("torchmha_deploy_test", "torchmha_deploy_other.pt");
  const auto failure = load_failure(path);
  EXPECT_FALSE(failure.operators_not_loaded) << failure.message;
  EXPECT_NE(failure.message.find("Unknown builtin op: torchmha_deploy_test::deploy_probe"), std::string::npos)
      << failure.message;
}

}  // namespace

// Runs a model that Python trained and saved (examples/deploy/export_model.py) from C++, without
// Python, and checks that it computes what Python computed:
//
//   deploy torchscript OUTPUT_DIR/model.pt  OUTPUT_DIR/reference.pt
//   deploy aoti        OUTPUT_DIR/model.pt2 OUTPUT_DIR/reference.pt
//
// torchscript: torchmha::load_scripted_module (torch::jit::load, which needs torchmha's operators:
//              this program links TorchMHA::torchmha), then forward.
// aoti:        torch::inductor::AOTIModelPackageLoader (LibTorch's; the package holds compiled aten
//              code, no torchmha operator), then run.
// reference.pt holds the fixed input (`tokens`) and Python's output for it (`logits`).
//
// Prints the largest difference; exits 0 when every value is within atol = rtol = 1e-5
// (|C++ - Python| <= atol + rtol * |Python|), 1 when not, 2 on an error (message on stderr).

#include <torchmha/deploy.h>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace {

constexpr double kTolerance = 1e-5;  // float32: atol and rtol

torch::Tensor run_torchscript(const std::string& path, const torch::Tensor& tokens) {
  torch::jit::Module model = torchmha::load_scripted_module(path);
  model.eval();
  torch::NoGradGuard no_grad;
  return model.forward({tokens}).toTensor();
}

torch::Tensor run_aoti(const std::string& path, const torch::Tensor& tokens) {
  torch::inductor::AOTIModelPackageLoader loader(path);
  torch::NoGradGuard no_grad;
  const auto outputs = loader.run({tokens});
  TORCH_CHECK(outputs.size() == 1, "the AOTInductor package returned ", outputs.size(), " outputs, expected 1");
  return outputs[0];
}

int usage(const char* program) {
  std::cerr << "usage: " << program << " torchscript|aoti MODEL REFERENCE\n"
            << "  MODEL: model.pt (torchscript) or model.pt2 (aoti); REFERENCE: reference.pt\n"
            << "  (all three written by examples/deploy/export_model.py)\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    return usage(argv[0]);
  }
  const std::string format = argv[1], model_path = argv[2], reference_path = argv[3];
  if (format != "torchscript" && format != "aoti") {
    return usage(argv[0]);
  }
  try {
    // A plain TorchScript container (no torchmha operator in it): its tensor attributes.
    const torch::jit::Module reference = torch::jit::load(reference_path);
    const auto tokens = reference.attr("tokens").toTensor();
    const auto expected = reference.attr("logits").toTensor();

    const auto actual = format == "torchscript" ? run_torchscript(model_path, tokens) : run_aoti(model_path, tokens);

    if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type()) {
      std::cout << format << ": FAILED: output " << actual.sizes() << " " << actual.scalar_type() << ", Python's "
                << expected.sizes() << " " << expected.scalar_type() << "\n";
      return 1;
    }
    const double max_difference = (actual - expected).abs().max().item<double>();
    const bool close = torch::allclose(actual, expected, /*rtol=*/kTolerance, /*atol=*/kTolerance);
    std::cout << format << ": max |C++ - Python| = " << max_difference << " over " << expected.numel()
              << " values (atol = rtol = " << kTolerance << "): " << (close ? "ok" : "FAILED") << "\n";
    return close ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << format << ": error: " << error.what() << "\n";
    return 2;
  }
}

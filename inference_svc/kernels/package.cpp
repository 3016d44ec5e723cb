// inference::Package: an AOTInductor package run with the GIL released.
//
// torch's Python binding of the package loader (torch._C._aoti.AOTIModelPackageLoader) holds
// the GIL for the whole forward pass (torch 2.13): while a decode step runs, no other Python
// thread of the service can run (the event loop answering health checks and streaming the
// last token, the text thread detokenizing it); they all run after it, while the compute
// thread waits for the GIL to start the next step. Measured at one stream (py-spy): 1.7 ms
// of an 11 ms token waiting for the GIL. A call of a torch op from Python releases the GIL,
// so the same loader, held by this class, is run by the op inference::run_package.
#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Package : torch::CustomClassHolder {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;

  Package(const std::string& path, const std::string& name)
      : loader(std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, name, false, 1,
                                                                          -1)) {}

  std::vector<std::string> constant_fqns() { return loader->get_constant_fqns(); }
  std::vector<std::string> call_spec() { return loader->get_call_spec(); }

  // The package runs on these tensors as they are (user managed: no copy); the caller keeps
  // them alive as long as the package.
  void load_constants(const c10::Dict<std::string, at::Tensor>& constants) {
    std::unordered_map<std::string, at::Tensor> map;
    for (const auto& item : constants) map.emplace(item.key(), item.value());
    loader->load_constants(map, false, true, true);
  }
};

std::vector<at::Tensor> run_package(const c10::intrusive_ptr<Package>& package,
                                    std::vector<at::Tensor> inputs) {
  return package->loader->boxed_run(std::move(inputs));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inference, m) {
  m.class_<Package>("Package")
      .def(torch::init<std::string, std::string>())
      .def("constant_fqns", &Package::constant_fqns)
      .def("call_spec", &Package::call_spec)
      .def("load_constants", &Package::load_constants);
  m.def("run_package(__torch__.torch.classes.inference.Package package, Tensor[] inputs)"
        " -> Tensor[]",
        &run_package);
}

// Adds the item codec to the native module (items.h).
#include "items/items.h"

#include <utility>

namespace torchshm {
namespace {

PyMethodDef functions[] = {
    {"read_strings", read_strings, METH_O,
     "A container's string table (a uint8 buffer) as a tuple of interned "
     "str (Note [Item format])."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

int add_item_codec(PyObject* module) {
  for (auto [name, spec] : {std::pair{"ItemEncoder", &item_encoder_spec},
                            std::pair{"ItemReader", &item_reader_spec}}) {
    PyObject* type = PyType_FromSpec(spec);
    int added = PyModule_AddObjectRef(module, name, type);
    Py_XDECREF(type);
    if (added < 0) return -1;
  }
  if (PyModule_AddFunctions(module, functions) < 0 ||
      PyModule_AddIntConstant(module, "ITEM_TAG", kItemTag) < 0 ||
      PyModule_AddIntConstant(module, "PICKLE_TAG", kPickleTag) < 0 ||
      PyModule_AddIntConstant(module, "ITEM_MAX_DEPTH", kMaxDepth) < 0)
    return -1;
  return 0;
}

}  // namespace torchshm

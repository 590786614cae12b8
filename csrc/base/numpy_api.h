// The one place that includes the NumPy C API. Every translation unit that
// uses NumPy includes this header; only module.cpp defines
// TORCHSHM_IMPORT_ARRAY and so owns the API table that import_array() fills.
#pragma once

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
// NumPy 2 hides the memory-handler API (NEP 49, 1.22) from older targets.
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL torchshm_ARRAY_API
#ifndef TORCHSHM_IMPORT_ARRAY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

// NumPy 2 hides PyArray_Descr's fields behind accessors; 1.x has no accessor.
inline npy_intp descr_itemsize(PyArray_Descr* descr) {
#if NPY_ABI_VERSION < 0x02000000
  return descr->elsize;
#else
  return PyDataType_ELSIZE(descr);
#endif
}

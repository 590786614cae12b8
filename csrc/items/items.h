// The items of SharedList and SharedDict: a native encoder for builtin values
// of exact types, and a reader type that decodes one item straight from the
// shared buffer in one C call (Note [Item codec] in torchshm/_containers.py
// says which items take this path and why).
//
// Note [Item format]
// An entry of a container's buffer is one item. Its first byte says how it
// is stored:
//   0x80  a pickle (protocol 5 starts with PROTO, 0x80): every item that
//         torchshm wrote before this format, and every item this format
//         cannot represent exactly; the reader calls Python's loader on it.
//   0x01  one value in the format below, nothing after it.
// A value is a tag byte and its payload; n is an unsigned LEB128 varint:
//   'N' None  'T' True  'F' False
//   'i' int: zigzag varint (-2**63 <= value < 2**63)
//   'f' float: its 8 bytes, little-endian (-0.0 and NaN payloads kept)
//   's' str: n, then n bytes of UTF-8 (lone surrogates as "surrogatepass")
//   'k' str: n, the index of an entry of the container's string table
//   'y' bytes: n, then n bytes
//   'l' list, 't' tuple: n, then n values
//   'd' dict: n, then n (key, value) pairs, in insertion order
// The string table is a separate uint8 array of entries (n, then n bytes of
// UTF-8); a process reads it once into interned str objects, so a table
// entry costs a read nothing (no allocation, hash cached). Nesting deeper
// than kMaxDepth is not encoded (the item is pickled instead).
//
// The buffer may come from another process: the reader bounds-checks every
// offset, length, count and table index, and a bad item raises ValueError
// naming it; nothing reads outside the buffer.
#pragma once

#include <Python.h>

#include <cstdint>

namespace torchshm {

constexpr uint8_t kItemTag = 0x01;
constexpr uint8_t kPickleTag = 0x80;
constexpr int kMaxDepth = 100;

// The two types and the string table's reader (item_encoder.cpp,
// item_reader.cpp).
extern PyType_Spec item_encoder_spec;
extern PyType_Spec item_reader_spec;
PyObject* read_strings(PyObject* module, PyObject* table);

// Adds ItemEncoder, ItemReader, read_strings and the constants above to the
// extension module. Returns -1 with a Python error set on failure.
int add_item_codec(PyObject* module);

}  // namespace torchshm

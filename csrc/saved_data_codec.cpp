// Note [saved_data encoding] (include/torch_opaque/detail/saved_data_codec.h):
// a C++ op's ctx.saved_data as the `_bwd` op's `state` argument, and back.
#include <torch_opaque/detail/saved_data_codec.h>

#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <charconv>
#include <string_view>

namespace torch_opaque::detail {
namespace {

bool plain_char(unsigned char c) {
  return std::isalnum(c) || c == '_' || c == '-' || c == '.' || c == ' ';
}

void append_escaped(std::string& out, std::string_view s) {
  for (unsigned char c : s) {
    if (plain_char(c)) {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789ABCDEF";
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
}

std::string unescape(std::string_view s) {
  if (s.find('%') == std::string_view::npos) return std::string(s);
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    int v = 0;
    if (s[i] == '%' && i + 2 < s.size() &&
        std::from_chars(s.data() + i + 1, s.data() + i + 3, v, 16).ec == std::errc()) {
      out += static_cast<char>(v);
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// Shortest text that reads back as exactly `d` (std::to_chars round-trips).
void append_double(std::string& out, double d) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof(buf), d);
  out.append(buf, r.ptr);
}

void append_int(std::string& out, int64_t i) {
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof(buf), i);
  out.append(buf, r.ptr);
}

template <class T>
T parse_number(std::string_view s) {
  T v{};
  auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  TORCH_CHECK(r.ec == std::errc() && r.ptr == s.data() + s.size(),
              "torch_opaque: malformed number '", std::string(s), "' in saved_data");
  return v;
}

// Calls f(piece) for each sep-separated piece of s (none for an empty s).
template <class F>
void for_each_piece(std::string_view s, char sep, F f) {
  if (s.empty()) return;
  size_t start = 0;
  while (true) {
    size_t p = s.find(sep, start);
    f(s.substr(start, p == std::string_view::npos ? std::string_view::npos : p - start));
    if (p == std::string_view::npos) break;
    start = p + 1;
  }
}

} // namespace

bool is_symint_list(const c10::IValue& v) {
  for (const c10::IValue& e : v.toListRef()) {
    if (!e.isInt() && !e.isSymInt()) return false;
  }
  return true;
}

std::string encode_saved_data(const std::string& op_name,
                              const std::map<std::string, c10::IValue>& data,
                              std::vector<c10::SymInt>* ints) {
  std::string out;
  out.reserve(32 * data.size());
  for (const auto& [name, v] : data) {
    append_escaped(out, name);
    out += '=';
    if (v.isNone()) {
      out += "n:";
    } else if (v.isBool()) {
      out += v.toBool() ? "b:1" : "b:0";
    } else if (v.isInt()) {
      out += "i:";
      append_int(out, v.toInt());
    } else if (v.isSymInt()) {
      ints->push_back(v.toSymInt());
      out += "y:";
      append_int(out, ints->size() - 1);
    } else if (v.isDouble()) {
      out += "f:";
      append_double(out, v.toDouble());
    } else if (v.isString()) {
      out += "s:";
      append_escaped(out, v.toStringRef());
    } else if (v.isIntList()) {
      out += "I:";
      bool first = true;
      for (int64_t x : v.toIntList()) {
        if (!first) out += ',';
        first = false;
        append_int(out, x);
      }
    } else if (v.isDoubleList()) {
      out += "F:";
      bool first = true;
      for (double x : v.toDoubleList()) {
        if (!first) out += ',';
        first = false;
        append_double(out, x);
      }
    } else if (v.isList() && is_symint_list(v)) {
      out += "Y:";
      bool first = true;
      for (const c10::IValue& e : v.toListRef()) {
        if (!first) out += ',';
        first = false;
        if (e.isInt()) {
          append_int(out, e.toInt());
        } else {
          ints->push_back(e.toSymInt());
          out += 's';
          append_int(out, ints->size() - 1);
        }
      }
    } else if (v.isBoolList()) {
      out += "B:";
      bool first = true;
      for (bool x : v.toBoolList()) {
        if (!first) out += ',';
        first = false;
        out += x ? '1' : '0';
      }
    } else {
      TORCH_CHECK(false, op_name, ": ctx.saved_data[\"", name, "\"] holds a ", v.tagKind(),
                  ", which cannot be passed to the backward op. Save tensors with "
                  "ctx.save_for_backward and keep ints, doubles, bools, strings, SymInts "
                  "or lists of ints/doubles/bools in saved_data.");
    }
    out += ';';
  }
  return out;
}

void check_saved_data(const std::string& op_name,
                      const std::map<std::string, c10::IValue>& data) {
  for (const auto& entry : data) {
    const c10::IValue& v = entry.second;
    const bool ok = v.isNone() || v.isBool() || v.isInt() || v.isSymInt() || v.isDouble() ||
        v.isString() || v.isIntList() || v.isDoubleList() || v.isBoolList() ||
        (v.isList() && is_symint_list(v));
    if (!ok) {
      std::vector<c10::SymInt> ints;
      encode_saved_data(op_name, {entry}, &ints);  // raises the error naming it
    }
  }
}

std::map<std::string, c10::IValue> decode_saved_data(const std::string& state,
                                                     const std::vector<c10::SymInt>& ints) {
  std::map<std::string, c10::IValue> data;
  for_each_piece(state, ';', [&](std::string_view entry) {
    if (entry.empty()) return;
    const size_t eq = entry.find('=');
    TORCH_CHECK(eq != std::string_view::npos && entry.size() >= eq + 3 && entry[eq + 2] == ':',
                "torch_opaque: malformed saved_data entry '", std::string(entry), "'");
    std::string name = unescape(entry.substr(0, eq));
    const char tag = entry[eq + 1];
    const std::string_view body = entry.substr(eq + 3);
    c10::IValue v;
    switch (tag) {
      case 'n': break;
      case 'b': v = body == "1"; break;
      case 'i': v = parse_number<int64_t>(body); break;
      case 'y': v = ints.at(parse_number<size_t>(body)); break;
      case 'f': v = parse_number<double>(body); break;
      case 's': v = unescape(body); break;
      case 'I': {
        std::vector<int64_t> l;
        for_each_piece(body, ',', [&](std::string_view x) { l.push_back(parse_number<int64_t>(x)); });
        v = l;
        break;
      }
      case 'F': {
        std::vector<double> l;
        for_each_piece(body, ',', [&](std::string_view x) { l.push_back(parse_number<double>(x)); });
        v = l;
        break;
      }
      case 'Y': {
        std::vector<c10::SymInt> l;
        for_each_piece(body, ',', [&](std::string_view x) {
          l.push_back(x.size() > 0 && x[0] == 's' ? ints.at(parse_number<size_t>(x.substr(1)))
                                                  : c10::SymInt(parse_number<int64_t>(x)));
        });
        v = c10::IValue(c10::SymIntArrayRef(l));
        break;
      }
      case 'B': {
        c10::List<bool> l;
        for_each_piece(body, ',', [&](std::string_view x) { l.push_back(x == "1"); });
        v = l;
        break;
      }
      default: TORCH_CHECK(false, "torch_opaque: unknown saved_data tag '", tag, "'");
    }
    data.emplace(std::move(name), std::move(v));
  });
  return data;
}

} // namespace torch_opaque::detail

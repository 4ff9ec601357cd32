#include "json.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

namespace flashkv::app {

const JsonValue* JsonValue::find(const std::string& key) const {
  for (const auto& m : members_)
    if (m.first == key) return &m.second;
  return nullptr;
}

std::string JsonValue::where() const { return str_cat("line ", line_, ", column ", column_); }

const char* JsonValue::type_name(Type t) {
  switch (t) {
    case Type::null:
      return "null";
    case Type::boolean:
      return "a boolean";
    case Type::number:
      return "a number";
    case Type::string:
      return "a string";
    case Type::array:
      return "an array";
    case Type::object:
      return "an object";
  }
  return "?";
}

// Recursive descent over the text, tracking line and column for messages.
class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}

  JsonValue document() {
    skip_space();
    JsonValue v = value(0);
    skip_space();
    if (pos_ < s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 200;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(str_cat("line ", line_, ", column ", column_, ": ", what));
  }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  char next() {
    const char c = s_[pos_++];
    if (c == '\n') {
      ++line_;
      column_ = 1;
    } else {
      ++column_;
    }
    return c;
  }
  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r'))
      next();
  }
  void expect_word(const char* word) {
    const int line = line_, column = column_;
    for (const char* w = word; *w; ++w) {
      if (peek() != *w)
        throw Error(str_cat("line ", line, ", column ", column, ": invalid literal (expected '",
                            word, "')"));
      next();
    }
  }

  JsonValue value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 200 levels");
    JsonValue v;
    v.line_ = line_;
    v.column_ = column_;
    if (at_end()) fail("unexpected end of text (expected a value)");
    const char c = peek();
    if (c == '{') {
      v.type_ = JsonValue::Type::object;
      object(v, depth);
    } else if (c == '[') {
      v.type_ = JsonValue::Type::array;
      array(v, depth);
    } else if (c == '"') {
      v.type_ = JsonValue::Type::string;
      v.string_ = string();
    } else if (c == 't') {
      expect_word("true");
      v.type_ = JsonValue::Type::boolean;
      v.boolean_ = true;
    } else if (c == 'f') {
      expect_word("false");
      v.type_ = JsonValue::Type::boolean;
    } else if (c == 'n') {
      expect_word("null");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.type_ = JsonValue::Type::number;
      v.number_ = number();
    } else {
      fail(str_cat("unexpected character '", std::string(1, c), "' (expected a value)"));
    }
    return v;
  }

  void object(JsonValue& v, int depth) {
    next();  // '{'
    skip_space();
    if (peek() == '}') {
      next();
      return;
    }
    for (;;) {
      skip_space();
      if (peek() != '"') fail("expected a member name in double quotes");
      const int key_line = line_, key_column = column_;
      std::string key = string();
      if (v.find(key))
        throw Error(
            str_cat("line ", key_line, ", column ", key_column, ": duplicate key \"", key, "\""));
      skip_space();
      if (peek() != ':') fail("expected ':' after a member name");
      next();
      skip_space();
      v.members_.emplace_back(std::move(key), value(depth + 1));
      skip_space();
      if (peek() == ',') {
        next();
        continue;
      }
      if (peek() == '}') {
        next();
        return;
      }
      fail(at_end() ? "unexpected end of text (unclosed '{')" : "expected ',' or '}' in an object");
    }
  }

  void array(JsonValue& v, int depth) {
    next();  // '['
    skip_space();
    if (peek() == ']') {
      next();
      return;
    }
    for (;;) {
      skip_space();
      v.items_.push_back(value(depth + 1));
      skip_space();
      if (peek() == ',') {
        next();
        continue;
      }
      if (peek() == ']') {
        next();
        return;
      }
      fail(at_end() ? "unexpected end of text (unclosed '[')" : "expected ',' or ']' in an array");
    }
  }

  unsigned hex4() {
    unsigned u = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = peek();
      u <<= 4;
      if (c >= '0' && c <= '9')
        u |= c - '0';
      else if (c >= 'a' && c <= 'f')
        u |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        u |= c - 'A' + 10;
      else
        fail("expected four hex digits after \\u");
      next();
    }
    return u;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    next();  // '"'
    std::string out;
    for (;;) {
      if (at_end()) fail("unexpected end of text (unterminated string)");
      const char c = peek();
      if (c == '"') {
        next();
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string (escape it)");
      if (c != '\\') {
        out += next();
        continue;
      }
      next();  // '\\'
      if (at_end()) fail("unexpected end of text (unterminated string)");
      const char e = next();
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a surrogate pair
            if (peek() != '\\') fail("unpaired UTF-16 surrogate in \\u escape");
            next();
            if (peek() != 'u') fail("unpaired UTF-16 surrogate in \\u escape");
            next();
            const unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired UTF-16 surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired UTF-16 surrogate in \\u escape");
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail(str_cat("invalid escape '\\", std::string(1, e), "'"));
      }
    }
  }

  // The JSON number grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  double number() {
    const size_t begin = pos_;
    auto digits = [&] {
      if (!(peek() >= '0' && peek() <= '9')) fail("malformed number (expected a digit)");
      while (peek() >= '0' && peek() <= '9') next();
    };
    if (peek() == '-') next();
    if (peek() == '0') {
      next();
      if (peek() >= '0' && peek() <= '9') fail("malformed number (leading zero)");
    } else {
      digits();
    }
    if (peek() == '.') {
      next();
      digits();
    }
    if (peek() == 'e' || peek() == 'E') {
      next();
      if (peek() == '+' || peek() == '-') next();
      digits();
    }
    const std::string text = s_.substr(begin, pos_ - begin);
    errno = 0;
    const double x = std::strtod(text.c_str(), nullptr);
    if (errno == ERANGE && std::isinf(x)) fail(str_cat("number ", text, " is out of range"));
    return x;
  }

  const std::string& s_;
  size_t pos_ = 0;
  int line_ = 1, column_ = 1;
};

JsonValue parse_json(const std::string& text) { return JsonParser(text).document(); }

JsonValue read_json_file(const std::string& path) {
  struct stat st {};
  FLASHKV_CHECK(::stat(path.c_str(), &st) == 0, path, ": cannot read (no such file)");
  FLASHKV_CHECK(S_ISREG(st.st_mode), path, ": cannot read (not a regular file)");
  std::ifstream in(path, std::ios::binary);
  FLASHKV_CHECK(in.good(), path, ": cannot read");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  FLASHKV_CHECK(!in.bad(), path, ": cannot read");
  try {
    return parse_json(text);
  } catch (const Error& e) {
    throw Error(str_cat(path, ": ", e.what()));
  }
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// Six significant digits; JSON has no infinities or NaN, so those become null.
std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  FLASHKV_CHECK(out.good(), "output file '", path, "': cannot open for writing");
  out << text;
  out.close();
  FLASHKV_CHECK(out.good(), "output file '", path, "': write failed");
}

}  // namespace flashkv::app

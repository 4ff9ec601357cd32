// A small JSON reader (RFC 8259) for the command line's input files, and the text helpers of its
// JSON writers: values keep the line and
// column they start at, so a bad file is reported as "line 3, column 14: ...".
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "flashkv/core/error.h"

namespace flashkv::app {

class JsonValue {
 public:
  enum class Type { null, boolean, number, string, array, object };

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::null; }
  bool is_bool() const { return type_ == Type::boolean; }
  bool is_number() const { return type_ == Type::number; }
  bool is_string() const { return type_ == Type::string; }
  bool is_array() const { return type_ == Type::array; }
  bool is_object() const { return type_ == Type::object; }

  bool boolean() const { return boolean_; }
  double number() const { return number_; }
  const std::string& string() const { return string_; }
  const std::vector<JsonValue>& items() const { return items_; }  // array elements
  // Object members in file order (keys are unique: the parser rejects duplicates).
  const std::vector<std::pair<std::string, JsonValue>>& members() const { return members_; }
  // The member named `key`, or null when absent (or when this is not an object).
  const JsonValue* find(const std::string& key) const;

  int line() const { return line_; }  // 1-based position of the value's first character
  int column() const { return column_; }
  std::string where() const;  // "line L, column C"
  static const char* type_name(Type t);

 private:
  friend class JsonParser;
  Type type_ = Type::null;
  bool boolean_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<JsonValue> items_;
  std::vector<std::pair<std::string, JsonValue>> members_;
  int line_ = 1, column_ = 1;
};

// Parses a whole document (one value, surrounded only by whitespace). Throws flashkv::Error
// "line L, column C: <what is wrong>" on malformed text, duplicate object keys, numbers outside
// the double range, or nesting deeper than 200 levels.
JsonValue parse_json(const std::string& text);

// Reads and parses a file; errors read "<path>: line L, column C: ..." (or "<path>: cannot
// read").
JsonValue read_json_file(const std::string& path);

// JSON text helpers shared by every JSON writer of the command line: a quoted, escaped string,
// and a number with six significant digits (null for infinities and NaN, which JSON lacks).
std::string json_string(const std::string& s);
std::string json_number(double x);

// Writes `text` to `path`; throws flashkv::Error naming the path when it cannot.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace flashkv::app

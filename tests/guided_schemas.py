"""JSON schemas for the structured-output tests: nested objects, arrays, enums, bounded numbers,
required and optional fields, string patterns. Strings and arrays are bounded so every output
completes well inside the tests' max_tokens."""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("a yes/no answer", {"type": "object", "properties": {"answer": {"type": "boolean"}},
                         "required": ["answer"]}),
    ("a color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                 "required": ["color"]}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "city": NAME}, "required": ["celsius", "city"]}),
    ("a list of three fruits", {"type": "object", "properties": {"fruits": {
        "type": "array", "items": NAME, "minItems": 3, "maxItems": 3}}, "required": ["fruits"]}),
    ("a book", {"type": "object", "properties": {"title": NAME, "author": NAME, "year": {
        "type": "integer", "minimum": 1450, "maximum": 2030}},
        "required": ["title", "author", "year"]}),
    ("an address", {"type": "object", "properties": {"street": NAME, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}),
    ("a user with an optional email", {"type": "object", "properties": {
        "username": {"type": "string", "pattern": "^[a-z]{3,10}$"},
        "email": {"type": "string", "maxLength": 24}}, "required": ["username"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10,
                                                         "maximum": 10},
                                                   "y": {"type": "integer", "minimum": -10,
                                                         "maximum": 10}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("an order", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
            "required": ["sku", "qty"]}}}, "required": ["id", "items"]}),
    ("a sentiment", {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "score"]}),
    ("a date", {"type": "object", "properties": {"date": {
        "type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}, "required": ["date"]}),
    ("a nested company", {"type": "object", "properties": {
        "company": {"type": "object", "properties": {
            "name": NAME, "ceo": {"type": "object", "properties": {"name": NAME},
                                  "required": ["name"]}},
            "required": ["name", "ceo"]}}, "required": ["company"]}),
    ("a tool call", {"type": "object", "properties": {
        "tool": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": NAME, "unit": {
            "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}},
        "required": ["tool", "arguments"]}),
    ("a rating", {"type": "object", "properties": {"stars": {
        "type": "integer", "minimum": 1, "maximum": 5}, "comment": NAME},
        "required": ["stars"]}),
    ("a list of scores", {"type": "object", "properties": {"scores": {
        "type": "array", "minItems": 2, "maxItems": 4, "items": {
            "type": "integer", "minimum": 0, "maximum": 100}}}, "required": ["scores"]}),
    ("an integer", {"type": "integer", "minimum": 10, "maximum": 99}),
    ("a list of tags", {"type": "array", "items": {"enum": ["news", "sports", "tech"]},
                        "minItems": 1, "maxItems": 3}),
    ("a phone contact", {"type": "object", "properties": {"name": NAME, "phone": {
        "type": "string", "pattern": "^\\+?[0-9]{7,12}$"}}, "required": ["name", "phone"]}),
    ("a product", {"type": "object", "properties": {
        "name": NAME, "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"},
        "category": {"enum": ["food", "tools", "toys"]}},
        "required": ["name", "price", "in_stock", "category"]}),
    ("a matrix", {"type": "object", "properties": {"rows": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {
                "type": "integer", "minimum": 0, "maximum": 9}}}}, "required": ["rows"]}),
    ("an event", {"type": "object", "properties": {
        "name": NAME, "kind": {"anyOf": [{"const": "online"}, {"const": "onsite"}]},
        "seats": {"type": ["integer", "null"], "minimum": 0, "maximum": 500}},
        "required": ["name", "kind", "seats"]}),
]

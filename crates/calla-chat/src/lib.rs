//! Chat templates and output parsers.

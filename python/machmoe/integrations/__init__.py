"""Optional integrations of machmoe with other training frameworks."""

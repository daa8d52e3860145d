"""A value of the wrong type for a config field of each type, and the type the refusal must name: what the config
tests and the command-line fuzz both give the fields of a list's entries."""

WRONG = {
    float: ("abc", "float"),
    int: ("abc", "int"),
    bool: ("abc", "bool"),
    str: ("[1]", "str"),
    dict: ("abc", "a mapping"),
}

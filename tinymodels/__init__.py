"""The tiny models the project builds on first use, for the demo, the tests and the benches: a recipe per
model (``recipes``), the text models (``text``: ``tiny``, ``tiny-gym``, ``mid``, ...), the tool-calling agent
(``agent``) and the vision-language model (``vl``). Built from the data's built-in tasks; never imports an
engine or a stage."""

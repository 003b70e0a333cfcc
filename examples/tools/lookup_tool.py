"""An example tool file for multi-turn rollouts (``rollout.multi_turn.tool_path=examples/tools/lookup_tool.py``).

``get_tools()`` returns the tools the model may call; ``get_interaction()`` (optional) speaks as the user
after a turn without a tool call. ``state`` is the episode's dict: the prompt row's ``data_source``,
``ground_truth``, ``extra_info`` and the ``turn`` number; a tool may keep its own keys in it.
"""

from megatron_rl.rollout.tools import Interaction, Tool

UNITS = {"km": 1000.0, "m": 1.0, "cm": 0.01, "mile": 1609.344}


class ConvertUnits(Tool):
    name = "convert_units"
    schema = {
        "type": "function",
        "function": {
            "name": "convert_units",
            "description": "Convert a length between km, m, cm and mile.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number"},
                    "from_unit": {"type": "string", "enum": sorted(UNITS)},
                    "to_unit": {"type": "string", "enum": sorted(UNITS)},
                },
                "required": ["value", "from_unit", "to_unit"],
            },
        },
    }

    def call(self, args, state):
        """-> (text the model reads, reward delta added to the episode's score, episode done?)"""
        state["conversions"] = state.get("conversions", 0) + 1
        value = float(args["value"]) * UNITS[args["from_unit"]] / UNITS[args["to_unit"]]
        return f"{value:.6g} {args['to_unit']}", 0.0, False  # a KeyError here reaches the model as an error


class AskForTheAnswerLine(Interaction):
    def respond(self, turn_text, state):
        """After a turn without a tool call: a user message (or None), a reward delta, done."""
        if "####" in turn_text or state["turn"] >= 3:
            return None, 0.0, True
        return "Please end with the final answer after '####'.", 0.0, False


def get_tools():
    return [ConvertUnits()]


def get_interaction():
    return AskForTheAnswerLine()

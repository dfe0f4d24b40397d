"""The trainers' side: their sessions and messages, what is sent to them, what they wait."""

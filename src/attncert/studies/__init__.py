"""Study code of stages whose method module is a single file."""

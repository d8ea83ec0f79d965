"""Operator commands (`hl7-agent queue ...`, `hl7-agent channel ...`)."""

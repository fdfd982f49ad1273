"""A site's secret reference (an Airflow connection field or variable) resolved where it is used."""

from __future__ import annotations

from flare_airflow.core.config import AirflowSecretRef


def secret_value(ref: AirflowSecretRef) -> str:
    """The value ``ref`` names, read through the Task SDK (a worker or the triggerer)."""
    from airflow.sdk import Connection, Variable

    if ref.variable is not None:
        return str(Variable.get(ref.variable))
    conn = Connection.get(str(ref.conn_id))
    if ref.field == "uri":
        value = conn.get_uri()
    elif ref.field.startswith("extra."):
        value = conn.extra_dejson.get(ref.field.removeprefix("extra."))
    else:
        value = getattr(conn, ref.field)
    if value is None or value == "":
        raise LookupError(f"the connection has no {ref.field}")
    return str(value)

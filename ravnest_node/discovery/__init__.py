"""Discovery: how a node learns of the other nodes of its swarm.

mDNS on a LAN (mdns.py) and, one layer up, bootstrap peers asked over gRPC
(coordination/locate.py). Whatever discovery yields is a hint, checked over gRPC before use.
"""

from ravnest_node.discovery.base import Discovery, StaticDiscovery
from ravnest_node.discovery.mdns import Advertisement, MdnsDiscovery, advertised_ips
from ravnest_node.discovery.records import (
    SERVICE_TYPE,
    Ignored,
    PeerRecord,
    Role,
    TxtRecord,
    encode_txt,
    parse_txt,
    peer_addresses,
)
from ravnest_node.state import valid_swarm_name

__all__ = [
    "SERVICE_TYPE",
    "Advertisement",
    "Discovery",
    "Ignored",
    "MdnsDiscovery",
    "PeerRecord",
    "Role",
    "StaticDiscovery",
    "TxtRecord",
    "advertised_ips",
    "encode_txt",
    "parse_txt",
    "peer_addresses",
    "valid_swarm_name",
]

//! Ports for servers a test or a harness starts, and restarts, on an address chosen in advance.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

/// A loopback address with a port that is free now and lies below the kernel's ephemeral range.
///
/// Binding port 0 hands out a port from the ephemeral range, which the kernel hands out again to any outgoing
/// connection (a database or broker client of a test running beside this one) as soon as the probe closes.
/// A server started on that port a moment later, or restarted on it after a crash, can then find it taken,
/// or a client can reach another test's server on it. Ports below the range are only ever bound on purpose:
/// this picks one at random and checks that it is free.
pub fn free_local_addr() -> SocketAddr {
    let (low, _) = ephemeral_range();
    let floor = low.saturating_sub(16_384).max(10_000);
    let span = u32::from(low.saturating_sub(floor)).max(1);
    for _ in 0..256 {
        let offset = uuid::Uuid::new_v4().as_u128() % u128::from(span);
        let port = u16::try_from(u128::from(floor) + offset)
            .expect("ports below the ephemeral range fit in u16");
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        if TcpListener::bind(addr).is_ok() {
            return addr;
        }
    }
    panic!("no free port below the ephemeral range ({floor}..{low})")
}

/// The kernel's ephemeral port range, or Linux's default where it cannot be read.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((parts.next()??, parts.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_free_and_below_the_ephemeral_range() {
        let addr = free_local_addr();
        assert!(addr.port() < ephemeral_range().0);
        assert!(addr.ip().is_loopback());
        TcpListener::bind(addr).expect("the port is free");
    }
}

//! Every binary of the example answers bad configuration with one line naming the setting and exit code 2,
//! never a panic.

use saga_test_support::{TestDb, expect_configuration_mistakes_named};

const BINARIES: [&str; 3] = [
    env!("CARGO_BIN_EXE_order-service"),
    env!("CARGO_BIN_EXE_payment-service"),
    env!("CARGO_BIN_EXE_shipping-service"),
];

#[tokio::test]
async fn every_service_names_a_bad_database_url_an_absent_database_or_broker_and_a_bad_flag() {
    let _db = TestDb::empty("cli-broker").await;
    expect_configuration_mistakes_named(&BINARIES, &BINARIES).await;
}

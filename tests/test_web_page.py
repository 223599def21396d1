"""The web page at / in a real headless browser (Debian's chromium, driven by selenium through chromium-driver):
load it, submit a prompt to the embedded default model, see progress (the live preview) and the finished image with
its parameters and download link, cancel a second job; the screenshot is docs/server.png."""

import shutil
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

import mlxdiff
from mlxdiff import default_model
from serve_helpers import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "server.png"

# Not a skip: the README's test command installs both, so a missing browser is a set-up failure to see.
MISSING = "" if CHROMIUM and DRIVER else ("the web page's test needs Debian's chromium and chromium-driver "
                                          "(apt-get install -y chromium chromium-driver; the README's test command "
                                          "installs them)")


@pytest.fixture(scope="module")
def page():
    if MISSING:
        pytest.fail(MISSING)
    pipe = mlxdiff.load(str(default_model.folder()), keep="auto")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1100,720"):
        options.add_argument(flag)
    with running_server(pipe) as (base, _):
        browser = webdriver.Chrome(service=Service(DRIVER), options=options)
        try:
            browser.get(base + "/")
            yield browser
        finally:
            browser.quit()


def cards(browser):
    return browser.find_elements(By.CSS_SELECTOR, "#jobs .job")


def submit(browser, prompt, steps, seed):
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "steps").get_attribute("value"))
    for name, value in (("prompt", prompt), ("steps", steps), ("seed", seed)):
        field = browser.find_element(By.ID, name)
        field.clear()
        field.send_keys(str(value))
    before = len(cards(browser))
    browser.find_element(By.ID, "submit").click()
    WebDriverWait(browser, 20).until(lambda b: len(cards(b)) == before + 1)
    return cards(browser)[0]         # the newest card is first


def test_page_generates_and_cancels(page):
    assert "klein-shapes" in WebDriverWait(page, 20).until(
        lambda b: b.find_element(By.ID, "model").text if "FLUX" in b.find_element(By.ID, "model").text else None)
    assert page.find_element(By.ID, "width").get_attribute("value") == "64"
    card = submit(page, default_model.PROMPT, 6, 7)
    WebDriverWait(page, 60).until(lambda b: card.get_attribute("data-status") in ("done", "error"))
    assert card.get_attribute("data-status") == "done", card.find_element(By.CLASS_NAME, "error").text
    assert card.get_attribute("data-last-step") == "6"               # progress seen up to the last step
    preview = card.find_element(By.CLASS_NAME, "preview").get_attribute("src")
    assert preview.startswith("data:image/png;base64,")               # the live preview was shown
    result = card.find_element(By.CLASS_NAME, "result")
    assert page.execute_script("return arguments[0].complete && arguments[0].naturalWidth", result) == 64
    assert "seed 7" in card.find_element(By.CLASS_NAME, "params").text
    assert card.find_element(By.CLASS_NAME, "download").get_attribute("download") == "mlxdiff-7.png"

    second = submit(page, "a large yellow diamond in the centre on a gray background", 1000, 8)
    WebDriverWait(page, 60).until(lambda b: second.get_attribute("data-status") == "progress")
    second.find_element(By.CLASS_NAME, "cancel").click()
    WebDriverWait(page, 30).until(lambda b: second.get_attribute("data-status") == "cancelled")
    assert int(second.get_attribute("data-last-step")) < 1000
    assert second.find_element(By.CLASS_NAME, "status").text == "cancelled"
    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert page.save_screenshot(str(SCREENSHOT))
